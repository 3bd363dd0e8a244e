"""The real launchers: `isthmus train --parallel.nproc N` (elastic launch) and an external torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from multirank import free_port

ARGS = ["--config", "tiny", "--train.steps", "6", "--train.val_every", "3", "--data.max_bytes", "200000",
        "--parallel.dp_replicate", "2"]


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "ISTHMUS_CACHE": str(tmp_path / "cache")}


def _losses(path: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def test_nproc_launch_and_torchrun_train_identically(tmp_path: Path) -> None:
    own = subprocess.run(
        [sys.executable, "-m", "isthmus", "train", *ARGS, "--parallel.nproc", "2",
         "--train.run_dir", str(tmp_path / "own"), "--data.cache_dir", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=300, env=_env(tmp_path),
    )
    assert own.returncode == 0, own.stderr[-3000:]
    assert "on 2 rank(s)" in own.stdout
    # Rank 0 alone drives the console; every rank has its own log file.
    assert own.stderr.count("step 6/6") == 1, own.stderr
    logs = tmp_path / "own" / "logs"
    assert (logs / "rank0.log").is_file() and "step 6/6" in (logs / "rank0.log").read_text()
    assert (logs / "rank1.log").is_file() and "layout dp_replicate=2 over 2 rank(s)" in (logs / "rank1.log").read_text()

    port = free_port()
    ext = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "isthmus", "train", *ARGS,
         "--train.run_dir", str(tmp_path / "ext"), "--data.cache_dir", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=300, env=_env(tmp_path),
    )
    assert ext.returncode == 0, ext.stderr[-3000:]
    assert ext.stdout.count("isthmus train: done") == 1  # only rank 0 prints the summary
    own_losses = _losses(tmp_path / "own" / "metrics.jsonl")
    assert own_losses == _losses(tmp_path / "ext" / "metrics.jsonl")
    assert len(own_losses) == 6 and own_losses[-1] < own_losses[0]


def test_torchrun_world_size_must_match_nproc(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "isthmus", "train", *ARGS, "--parallel.nproc", "4",
         "--train.run_dir", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=300, env=_env(tmp_path),
    )
    assert proc.returncode != 0
    assert "isthmus: error: parallel.nproc = 4" in proc.stderr
    # Each rank stops with our one line before training; torchrun then reports the failed ranks itself.
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_user_error_inside_ranks_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "ck" / "step-000002"
    bad.mkdir(parents=True)
    (bad / "isthmus.json").write_text("not json")
    proc = subprocess.run(
        [sys.executable, "-m", "isthmus", "train", *ARGS, "--parallel.nproc", "2", "--train.run_dir", str(tmp_path / "r"),
         "--data.cache_dir", str(tmp_path / "cache"), "--checkpoint.resume", str(bad)],
        capture_output=True, text=True, timeout=300, env=_env(tmp_path),
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert errors == [f"isthmus: error: {bad / 'isthmus.json'}: not a valid checkpoint manifest "
                      "(JSONDecodeError: Expecting value: line 1 column 1 (char 0)) (rank0)"], proc.stderr
