"""benchmarks/moe.py end to end: isthmus ep 2, the hand-written torch ep loop and one process, timed in
turns on real gloo ranks, print tokens/s, ratios, equal first losses and the all-to-all's share."""

from __future__ import annotations

import json
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
    cmd = [sys.executable, str(ROOT / "benchmarks" / "moe.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)


@pytest.mark.slow
def test_two_operating_points_same_first_loss_and_a2a_share(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    args = ("--rounds", "1", "--steps", "1", "--warmup", "0", "--batch", "4", "--seq-len", "32,64")
    res = run_bench(*args, "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [[c.strip() for c in m.group(2).split("|")] for m in re.finditer(r"^\| (32|64) \|(.*)\|$", res.stdout, re.M)]
    speed, share = [r for r in rows if len(r) == 6], [r for r in rows if len(r) == 3]
    assert len(speed) == 2 and len(share) == 2, res.stdout
    for one, ep2, torch_, vs_one, vs_torch, losses in speed:
        assert min(float(c.replace(",", "")) for c in (one, ep2, torch_)) > 0, speed
        assert re.fullmatch(r"[\d.]+ \([\d.]+\)", vs_one) and re.fullmatch(r"[\d.]+ \([\d.]+\)", vs_torch)
        # Same model, init and batches: the three start from the same loss.
        assert len(set(losses.split(" / "))) == 1, losses
    for isthmus_share, torch_share, calls in share:
        assert re.fullmatch(r"[\d.]+% / [\d.]+%", isthmus_share) and re.fullmatch(r"[\d.]+% / [\d.]+%", torch_share)
        # Each of the 4 MoE layers: counts, tokens there and back; both token all-to-alls again in backward.
        assert calls == "20", share
    assert len(json.loads(out.read_text())["seconds"]) == 6


def test_an_odd_batch_is_refused_before_any_rank_starts() -> None:
    res = run_bench("--batch", "7")
    assert res.returncode == 2
    assert "--batch 7: must be a positive multiple of 2" in res.stderr
