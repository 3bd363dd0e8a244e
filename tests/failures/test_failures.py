"""A rank that dies: `parallel.max_restarts` restarts the ranks, which resume from the newest good checkpoint.

The kill test runs the real CLI as a subprocess, waits until `metrics.jsonl` reaches step 7 and
SIGKILLs rank 1's process (found in the process tree by the log file it holds open): no test hook
in the library. The three launches (uninterrupted, killed with a restart, killed without) run side
by side to keep the wall time down; each is compared only with itself and the uninterrupted one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from isthmus.config import build_config, parse_overrides
from isthmus.errors import ConfigError, IsthmusError
from isthmus.launch.local import last_logged_step, launch, prepare_restart
from procs import holder_of, isthmus_argv, tiny_run

STEPS = 24
ARGS = [
    *tiny_run(STEPS),
    "--parallel.nproc",
    "2",
    "--parallel.dp_replicate",
    "2",
    "--checkpoint.every",
    "4",
    "--metrics.log_every",
    "4",
]
KILL_AT = 7


class Run:
    """`isthmus train` in a subprocess."""

    def __init__(self, tmp: Path, name: str, *extra: str) -> None:
        self.dir = tmp / name
        args = [*ARGS, "--train.run_dir", str(self.dir), "--data.cache_dir", str(tmp / "cache"), *extra]
        env = {**os.environ, "ISTHMUS_CACHE": str(tmp / "cache")}
        self.proc = subprocess.Popen(
            isthmus_argv("train", *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.killed_at: int | None = None

    def kill_rank_at(self, rank: int, step: int, timeout: float = 240) -> None:
        """SIGKILL ``rank``'s process once the run has logged ``step``."""
        deadline = time.monotonic() + timeout
        while last_logged_step(self.dir / "metrics.jsonl") < step:
            assert self.proc.poll() is None, "the run ended before the kill"
            assert time.monotonic() < deadline, "the run never reached the step"
            time.sleep(0.005)
        pid = holder_of(self.proc.pid, self.dir / "logs" / f"rank{rank}.log")
        self.killed_at = last_logged_step(self.dir / "metrics.jsonl")
        os.kill(pid, signal.SIGKILL)

    def wait(self, timeout: float = 240) -> tuple[int, str]:
        _, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, err

    def losses(self) -> list[tuple[int, float]]:
        records = map(json.loads, (self.dir / "metrics.jsonl").read_text().splitlines())
        return [(r["step"], r["loss"]) for r in records if "loss" in r]

    def final(self) -> dict[str, torch.Tensor]:
        return torch.load(self.dir / "final" / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Run, int, str]]:
    tmp = tmp_path_factory.mktemp("failures")
    started = {
        "straight": Run(tmp, "straight"),
        "restarted": Run(tmp, "restarted", "--parallel.max_restarts", "1"),
        "no_restart": Run(tmp, "no_restart"),
    }
    started["restarted"].kill_rank_at(1, KILL_AT)
    started["no_restart"].kill_rank_at(1, KILL_AT)
    return {name: (run, *run.wait()) for name, run in started.items()}


@pytest.mark.slow
def test_sigkilled_rank_restarts_and_matches_the_uninterrupted_run(runs: dict[str, tuple[Run, int, str]]) -> None:
    straight, code, err = runs["straight"]
    assert code == 0, err[-3000:]
    run, code, err = runs["restarted"]
    assert code == 0, err[-3000:]
    assert run.killed_at is not None and KILL_AT <= run.killed_at < STEPS
    notes = [line for line in err.splitlines() if line.startswith("restart ")]
    assert len(notes) == 1, err[-3000:]
    # e.g. "restart 1/1: a rank failed after step 7; resuming from step-000004 (steps 5..7 are redone)"
    assert notes[0].startswith("restart 1/1: a rank failed after step ") and "resuming from step-0000" in notes[0], (
        notes
    )
    assert "Traceback" not in err
    # Every step once, each loss bit-identical to the uninterrupted run's, and the same final weights.
    assert run.losses() == straight.losses()
    assert [s for s, _ in run.losses()] == list(range(1, STEPS + 1))
    ref = straight.final()
    got = run.final()
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.slow
def test_sigkilled_rank_without_restarts_fails_in_one_line(runs: dict[str, tuple[Run, int, str]]) -> None:
    run, code, err = runs["no_restart"]
    assert code == 3  # a run that failed (errors.EXIT_RUN_FAILED)
    errors = [line for line in err.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err[-3000:]
    assert errors[0].startswith("isthmus: error: rank ") and "no restart (parallel.max_restarts = 0)" in errors[0], (
        errors
    )
    assert not (run.dir / "final").exists()


# --- config and the restart decision, in this process ----------------------------------------------
def _cfg(tmp: Path, *extra: str):  # noqa: ANN202
    return build_config(None, parse_overrides(["--train.run_dir", str(tmp / "run"), *extra]))


def test_max_restarts_needs_checkpoints(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        _cfg(tmp_path, "--parallel.max_restarts", "1")
    assert (
        str(err.value) == "parallel.max_restarts = 1: needs checkpoint.every > 0 (a restart resumes from a checkpoint)"
    )
    with pytest.raises(ConfigError, match="parallel.max_restarts = -1: must be 0"):
        _cfg(tmp_path, "--parallel.max_restarts", "-1")


def test_max_restarts_under_an_external_launcher_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(IsthmusError, match="torchrun --max-restarts"):
        launch(_cfg(tmp_path, "--parallel.max_restarts", "1", "--checkpoint.every", "2"))


def _fake_checkpoint(root: Path, step: int, mtime: float) -> None:
    directory = root / f"step-{step:06d}"
    directory.mkdir(parents=True)
    (directory / "isthmus.json").write_text("{}")
    os.utime(directory / "isthmus.json", (mtime, mtime))


def test_a_restart_resumes_from_this_launchs_newest_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    cfg = _cfg(tmp_path, "--parallel.max_restarts", "2", "--checkpoint.every", "4")
    root, now = tmp_path / "run" / "checkpoints", time.time()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 9, "loss": 1.0}\n{"step": 10, "lo')  # torn by the kill

    assert last_logged_step(tmp_path / "run" / "metrics.jsonl") == 9
    assert prepare_restart(cfg, 1, now) == (
        "restart 1/2: a rank failed after step 9, before this run's first checkpoint; starting over (steps 1..9 are redone)"
    )
    assert cfg.checkpoint.resume == "none"  # as the first attempt started
    _fake_checkpoint(root, 40, now - 3600)  # an earlier run's, in the same directory
    _fake_checkpoint(root, 8, now + 1)
    assert (
        prepare_restart(cfg, 2, now)
        == "restart 2/2: a rank failed after step 9; resuming from step-000008 (step 9 is redone)"
    )
    assert cfg.checkpoint.resume == str(root / "step-000008")
    (root / "step-000040" / "isthmus.json").unlink()
    (root / "step-000040").rmdir()
    prepare_restart(cfg, 2, now)
    assert cfg.checkpoint.resume == "auto"  # ours is the newest: auto, which also falls back past a damaged one
