"""A full disk, on a real small tmpfs: one line with "no space left on device" and the file, exit 3, no leftovers.

Mounting needs root; the tests fail (they are not skipped) without it. Each case gets a tmpfs of its
own, sized to fill at the write under test, and every mount is removed after. The runs go side by
side; the data cache stays off the small disks.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from procs import BASE_ARGS, Train, last_line

SHORT = [*BASE_ARGS, "--train.steps", "6"]  # the later --train.steps wins
# name: (tmpfs size, bytes to fill it with first, ranks, extra args with {mnt}, what the line names, key)
CASES = {
    "checkpoint_two_ranks": (
        "1m",
        0,
        2,
        ["--checkpoint.every", "2"],
        "checkpoint of step 2 {mnt}/run/checkpoints/step-000002.partial",
        "checkpoint.dir",
    ),
    "checkpoint_async": (
        "1m",
        0,
        1,
        ["--checkpoint.every", "2", "--checkpoint.async", "true"],
        "checkpoint of step 2 {mnt}/run/checkpoints/step-000002.partial",
        "checkpoint.dir",
    ),
    "final_model_two_ranks": ("600k", 0, 2, [], "final model {mnt}/run/final/model.pt", "train.run_dir"),
    "metrics": (
        "4k",
        0,
        1,
        ["--train.run_dir", "{tmp}/metrics_run", "--metrics.jsonl", "{mnt}/m.jsonl", "--train.steps", "100"],
        "metrics {mnt}/m.jsonl",
        "metrics.jsonl",
    ),
    "config": ("4k", 4096, 1, [], "config {mnt}/run/config.toml", "train.run_dir"),
}


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("the full-disk tests mount small tmpfs file systems, which needs root; run them as root")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Train, Path]]]:
    _require_root()
    tmp = tmp_path_factory.mktemp("disk")
    mounted: list[Path] = []
    try:
        started = {}
        for name, (size, fill, n, extra, _, _) in CASES.items():
            mnt = tmp / name
            mnt.mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=True)
            mounted.append(mnt)
            if fill:
                (mnt / "fill").write_bytes(b"\0" * fill)
            args = [a.format(mnt=mnt, tmp=tmp) for a in extra]
            started[name] = (Train(mnt / "run", tmp / "cache", "--parallel.nproc", str(n), *args, base=SHORT), mnt)
        for run, _ in started.values():
            run.wait()
        yield started
    finally:
        for mnt in mounted:
            subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_a_full_disk_is_one_line_naming_the_file(name: str, runs: dict[str, tuple[Train, Path]]) -> None:
    run, mnt = runs[name]
    _, _, n, _, what, key = CASES[name]
    assert run.code == 3, run.err[-3000:]
    line = last_line(run.err)
    expected = f"isthmus: error: no space left on device writing the {what.format(mnt=mnt)}; free space there or set {key} to another disk"
    assert line == expected + (" (rank0)" if n > 1 else ""), line
    # Nothing half-written is left: no model.pt.tmp, no checkpoint directory of the failed save.
    assert not list(mnt.rglob("*.tmp")) and not list(mnt.rglob("*.partial"))
    assert not (mnt / "run" / "final" / "model.pt").exists()
