"""benchmarks/wan_receives.py's table: each WAN step over the LAN step of its own schedule, and the
variants' losses checked equal (where a receive is posted moves no byte)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import wan_receives  # noqa: E402


def _raw(losses_of_ahead: list[float]) -> dict:
    steps = {"lan 1f1b": 0.5, "lan gpipe": 0.4, "on_use 1f1b": 1.0, "time_shared 1f1b": 1.2}
    steps |= {"ahead 1f1b": 0.7, "ahead gpipe": 0.6}
    runs = {
        n: [{"step_s": s, "losses": losses_of_ahead if n.startswith("ahead") else [3.0, 2.5], "load": 1.0}]
        for n, s in steps.items()
    }
    return {"mbit": 100.0, "method": "int8", "steps": 6, "runs": {"16": runs}}


def test_ratios_are_against_the_same_schedule_on_the_lan() -> None:
    lines = wan_receives.table(_raw([3.0, 2.5]))
    row = next(line for line in lines if line.startswith("| 16 |"))
    assert "0.700 (1.40)" in row and "0.600 (1.50)" in row and "1.000 (2.00)" in row


def test_unequal_losses_fail_the_table() -> None:
    with pytest.raises(AssertionError, match="losses differ"):
        wan_receives.table(_raw([3.0, 2.6]))


def test_a_subset_of_variants_tables_only_those_and_names_the_windows() -> None:
    raw = _raw([3.0, 2.5])
    raw["runs"]["16"] = {n: r for n, r in raw["runs"]["16"].items() if n in ("lan 1f1b", "lan gpipe", "ahead gpipe")}
    lines = wan_receives.table({**raw, "window_kib": 0})
    assert "autotuned TCP windows" in lines[0]
    header = next(line for line in lines if line.startswith("| batch"))
    assert "ahead gpipe" in header and "on_use" not in header and "ahead 1f1b" not in header
    assert "TCP windows 64 KiB" in wan_receives.table(_raw([3.0, 2.5]))[0]
