"""ZeRO-1 (Megatron's distributed optimizer) next to tensor parallelism through the command line,
on local gloo ranks; its numerics are in `test_parallel_equivalence` (cases ``*_zero1_*``)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from procs import run_isthmus, tiny_run


@pytest.mark.slow
def test_zero1_with_tp_trains_from_the_command_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    layout = ["--parallel.nproc", "4", "--parallel.dp_shard", "2", "--parallel.zero_stage", "1", "--parallel.tp", "2"]
    done = run_isthmus(
        "train", *tiny_run(2), *layout, "--train.run_dir", str(run), "--metrics.progress", "false", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ran = tomllib.loads((run / "config.toml").read_text())["parallel"]
    assert (ran["dp_shard"], ran["zero_stage"], ran["tp"]) == (2, 1, 2)
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("step") == 2 for r in steps)
