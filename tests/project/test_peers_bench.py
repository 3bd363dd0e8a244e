"""benchmarks/peers.py end to end: real spawned gloo ranks time isthmus's Trainer against the
hand-written torch loops and print the table, with a ratio and the first step's losses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "ISTHMUS_MAX_STEPS"}
    env["PYTHONPATH"] = str(ROOT / "src")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "peers.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.slow
def test_two_modes_print_ratios_and_equal_first_losses(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    res = run_bench(
        "--modes", "ddp,zero3", "--rounds", "1", "--steps", "1", "--warmup", "0", "--no-colossal", "--out", str(out)
    )
    assert res.returncode == 0, res.stderr[-2000:]
    cells = [
        (line.split("|")[1].strip(), [c.strip() for c in line.split("|")[2:-1]])
        for line in res.stdout.splitlines()
        if re.match(r"\| (ddp|zero3) \|", line)
    ]
    rows = {mode: row for mode, row in cells if len(row) == 6}
    assert set(rows) == {"ddp", "zero3"}, res.stdout
    # The DDP bound's table: isthmus's DDP step without its all-reduce, and isthmus over it.
    [(_, (bound, bound_vs_colossal, vs_bound))] = [(m, row) for m, row in cells if len(row) == 3]
    assert float(bound.replace(",", "")) > 0 and bound_vs_colossal == "-", res.stdout
    assert re.fullmatch(r"[\d.]+ \([\d.]+\)", vs_bound), res.stdout
    for mode, (mine, torch_, colossal, vs_torch, vs_colossal, losses) in rows.items():
        assert float(mine.replace(",", "")) > 0 and float(torch_.replace(",", "")) > 0, (mode, rows[mode])
        assert colossal == "n/a (--no-colossal)" and vs_colossal == "-"
        # "median (round ratios)": one round, so both numbers are that round's ratio.
        ratio, rounds = re.fullmatch(r"([\d.]+) \(([\d.]+)\)", vs_torch).groups()
        assert 0 < float(ratio) and abs(float(ratio) - float(rounds)) < 0.01
        # Same model, init and batch: isthmus and the textbook loop start from the same loss.
        isthmus_loss, torch_loss, _ = losses.split(" / ")
        assert isthmus_loss == torch_loss, (mode, losses)
    assert out.exists() and '"seconds"' in out.read_text()


def test_unknown_mode_is_refused_before_any_rank_starts() -> None:
    res = run_bench("--modes", "ddp,zero4")
    assert res.returncode == 2
    assert "--modes zero4: each must be one of" in res.stderr
