"""A run owns its directory: fresh names per run, a lock while it lives, no silent reuse of another run's files."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path

import pytest

from isthmus.cli import main
from procs import isthmus_argv

QUICK = [
    "--config",
    "tiny",
    "--train.steps",
    "2",
    "--train.val_every",
    "0",
    "--train.val_batches",
    "1",
    "--data.max_bytes",
    "60000",
    "--metrics.progress",
    "false",
]


@pytest.fixture()
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh working directory (the default run_dir is relative) and a shared tokenised-data cache."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ISTHMUS_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _train(*extra: str) -> int:
    return main(["train", *QUICK, "--data.cache_dir", "cache", *extra])


def _digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("isthmus: error: "), lines
    return lines[0]


@pytest.mark.slow
def test_every_run_gets_a_fresh_directory_and_latest_names_the_newest(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _train() == 0
    assert _train("--train.seed", "1") == 0
    runs = sorted(p for p in (here / "runs").iterdir() if not p.is_symlink())
    assert len(runs) == 2 and all(p.name.startswith("tiny-") for p in runs), runs
    latest = here / "runs" / "latest"
    assert latest.is_symlink() and latest.resolve() == runs[-1].resolve()
    assert "seed = 1" in (latest / "config.toml").read_text()
    assert "seed = 0" in (runs[0] / "config.toml").read_text()  # the first run's files are untouched
    capsys.readouterr()
    assert main(["generate", "--max-new-tokens", "5"]) == 0  # reads runs/latest by default
    assert capsys.readouterr().out.startswith("def ")


@pytest.mark.slow
def test_a_named_directory_holding_an_earlier_run_is_refused_and_left_as_it_was(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _train("--train.run_dir", "runs/mine") == 0
    before = _digest(here / "runs" / "mine")
    capsys.readouterr()
    assert _train("--train.run_dir", "runs/mine", "--train.seed", "3") == 2
    line = _error(capsys)
    assert "train.run_dir = 'runs/mine': holds an earlier run" in line and "--train.overwrite true" in line, line
    assert _train("--train.run_dir", "runs/mine", "--checkpoint.resume", "auto") == 2  # nothing to continue from
    assert "no checkpoint to continue from" in _error(capsys)
    assert _digest(here / "runs" / "mine") == before
    assert _train("--train.run_dir", "runs/mine", "--train.seed", "3", "--train.overwrite", "true") == 0
    assert "seed = 3" in (here / "runs" / "mine" / "config.toml").read_text()


@pytest.mark.slow
def test_a_second_live_run_on_the_same_directory_gets_one_line(here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = subprocess.Popen(
        isthmus_argv(
            "train",
            *QUICK,
            "--data.cache_dir",
            "cache",
            "--train.steps",
            "400",
            "--train.run_dir",
            "runs/shared",
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )
    try:
        lock = here / "runs" / "shared" / ".lock"
        deadline = time.monotonic() + 60
        while not (lock.is_file() and lock.read_text().strip()):
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read() if first.stderr else ""
            time.sleep(0.2)
        assert _train("--train.run_dir", "runs/shared") == 2
        line = _error(capsys)
        assert "train.run_dir = 'runs/shared': is in use by a live run (pid " in line and str(first.pid) in line, line
    finally:
        first.kill()
        first.wait()
    # The kernel drops the lock with its holder, even one killed by SIGKILL: the directory is free again.
    assert _train("--train.run_dir", "runs/shared", "--train.overwrite", "true") == 0


@pytest.mark.slow
def test_resume_auto_continues_only_the_same_run(here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = ["--checkpoint.every", "2"]
    assert _train(*ckpt) == 0
    (run,) = [p for p in (here / "runs").iterdir() if not p.is_symlink()]
    before = _digest(run)
    capsys.readouterr()
    assert _train(*ckpt, "--train.steps", "4", "--checkpoint.resume", "auto", "--train.lr", "1e-3") == 2
    line = _error(capsys)
    assert "saved by a run with other settings (train.lr: 0.003 -> 0.001)" in line, line
    assert _digest(run) == before  # refused before anything was written
    # The same settings (a longer run, another layout) continue the newest run of this config, in its directory.
    assert _train(*ckpt, "--train.steps", "4", "--checkpoint.resume", "auto") == 0
    assert [p for p in (here / "runs").iterdir() if not p.is_symlink()] == [run]
    steps = [line for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(steps) == 4  # steps 1-2 of the first run, then 3-4 appended


@pytest.mark.slow
def test_other_runs_checkpoints_and_metrics_are_never_adopted(here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shared = ["--checkpoint.dir", "ckpts", "--checkpoint.every", "2"]
    assert _train(*shared, "--train.run_dir", "runs/a", "--metrics.jsonl", "a.jsonl") == 0
    capsys.readouterr()
    assert _train(*shared, "--train.run_dir", "runs/b") == 2
    assert "checkpoint.dir = 'ckpts': holds an earlier run (checkpoints up to step 2)" in _error(capsys)
    assert _train("--train.run_dir", "runs/c", "--metrics.jsonl", "a.jsonl") == 2
    assert "a.jsonl" in _error(capsys)
    assert len((here / "a.jsonl").read_text().splitlines()) == 3  # steps 1, 2 and the final validation, untouched
