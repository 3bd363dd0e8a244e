"""benchmarks/geo_sync.py's figures: the mean training loss over the last steps beside the final
validation loss, and the across-seeds tables of both against flat's at the same seed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import geo_sync  # noqa: E402


def _records(losses: list[float], val: float) -> list[dict]:
    steps = [{"step": i + 1, "loss": x, "step_time_s": 0.1, "wan_bytes": 10} for i, x in enumerate(losses)]
    return [*steps, {"step": len(losses), "val_loss": val}]


def _summary(spec: str, losses: list[float], val: float, tail: int = 2) -> geo_sync.Summary:
    st = geo_sync.Strategy(spec)
    return geo_sync.summarise(st.label(10), st, _records(losses, val), 10, tail)


def test_tail_is_the_mean_of_the_last_steps_only() -> None:
    s = _summary("flat", [9.0, 9.0, 3.0, 2.0, 1.0], 2.5, tail=3)
    assert s.tail_train == pytest.approx(2.0)
    assert s.final_val == 2.5 and s.wan_bytes == 50
    assert _summary("flat", [4.0], 2.5, tail=3).tail_train == 4.0  # fewer steps than the tail: all of them


def test_seed_table_gaps_are_against_flat_at_the_same_seed() -> None:
    by_seed = {
        2: [_summary("flat", [2.0, 2.0], 2.0), _summary("diloco", [2.2, 2.2], 2.02)],
        3: [_summary("flat", [4.0, 4.0], 2.5), _summary("diloco", [3.6, 3.6], 2.45)],
    }
    val = geo_sync.seed_table(by_seed, "final_val", "val")
    assert val[2].startswith("| flat | 2.0000 | 2.5000 | 2.2500 | spread 25.00% |")
    assert "| +1.00% | -2.00% | -0.50% | +1.00% |" in val[3]
    train = geo_sync.seed_table(by_seed, "tail_train", "train")
    assert "| +10.00% | -10.00% | +0.00% | +10.00% |" in train[3]


def test_quality_table_prints_both_figures(capsys: pytest.CaptureFixture[str]) -> None:
    ns = argparse.Namespace(steps=2, tail_steps=2)
    geo_sync.print_quality([_summary("flat", [2.0, 2.0], 2.0), _summary("diloco", [2.2, 2.2], 2.02)], ns)
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| diloco"))
    assert "| 2.0200 | +1.00% | 2.2000 | +10.00% |" in row
