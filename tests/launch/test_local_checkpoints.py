"""Checkpoints in per-host folders (`isthmus.checkpoint.hostlocal`) and a host whose only rank is stopped.

Two emulated hosts of one rank each (FSDP across them, `tiny`, a checkpoint every 4 steps); host 1's run folder is
its own (a folder of the test bind-mounted over the runs folder in host 1's own mount namespace),
so neither host sees the other's checkpoint files. One uninterrupted run saves steps 4 and 8 (each
host its own shards, its own metadata and manifest) and is stopped after step 8; a second run on the
same hosts resumes from step 4, saving asynchronously, and must log the losses of steps 5 to 8
exactly and commit its step-8 checkpoint in each host's folder; then its host 1's
rank is SIGSTOPped, and both hosts must end in one line naming rank 1 on host1, exit 3, with every
process gone. Meanwhile a single process on host 0 resuming the same checkpoint (world 1: it would
need host 1's shards) is refused in one line, exit 2.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from isthmus.launch.hosts import EmulatedHosts, torchrun_argv
from isthmus.launch.jobwatch import END_KEY, HostGuard, JobEnd
from isthmus.launch.rundir import lock_host_dir
from procs import gone, holder_of, needs_hosts

B = ["--config", "tiny", "--train.val_every", "0", "--train.batch_size", "8", "--train.seq_len", "32"]
B += ["--data.max_bytes", "60000", "--train.threads", "1", "--train.steps", "2000", "--metrics.log_every", "1"]
B += ["--checkpoint.every", "4", "--parallel.timeout_s", "6"]


def _losses(path: Path) -> dict[int, float]:
    try:
        records = [json.loads(line) for line in path.read_text().splitlines()]
    except (OSError, ValueError):
        return {}
    return {r["step"]: r["loss"] for r in records if "loss" in r and "step" in r}


def _start(hosts: EmulatedHosts, runs: Path, own: Path, name: str, *extra: str) -> list[subprocess.Popen[str]]:
    target = ["-m", "isthmus", "train", *B, "--parallel.dp_shard", "2", "--train.run_dir", str(runs / name), *extra]
    procs = []
    for i in range(2):
        argv = torchrun_argv(2, 1, "host0:29400", f"local-ckpt-{name}", target)
        if i == 1:  # host 1 sees its own folder where host 0 has the runs folder
            mount = 'mount --bind "$1" "$0" && shift && exec "$@"'
            argv = [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                mount,
                str(runs),
                str(own),
                *argv,
            ]
        procs.append(hosts.popen(i, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _wait(procs: list[subprocess.Popen[str]], ready: object, timeout: float = 150) -> None:
    deadline = time.monotonic() + timeout
    while not ready() and time.monotonic() < deadline:  # type: ignore[operator]
        assert all(p.poll() is None for p in procs), [(p.returncode, p.communicate()) for p in procs]
        time.sleep(0.2)
    assert ready(), "timed out"  # type: ignore[operator]


@pytest.mark.slow
@needs_hosts
def test_per_host_checkpoints_resume_exactly_and_a_stopped_host_ends_in_one_line(tmp_path: Path) -> None:
    runs, own = tmp_path / "runs", tmp_path / "host1-runs"
    runs.mkdir()
    own.mkdir()
    with EmulatedHosts(2) as hosts:
        # The uninterrupted run: steps 1 to 8, checkpoints at 4 and 8 on both hosts.
        first = _start(hosts, runs, own, "a")
        step8 = "a/checkpoints/step-000008/isthmus.json"
        _wait(
            first,
            lambda: (runs / step8).is_file() and (own / step8).is_file() and 8 in _losses(runs / "a/metrics.jsonl"),
        )
        os.kill(first[1].pid, signal.SIGTERM)
        for p in first:
            p.communicate(timeout=60)
        # Each host holds its own rank's shards, and the metadata and manifest to read them.
        for folder, rank in ((runs, 0), (own, 1)):
            names = {p.name for p in (folder / "a/checkpoints/step-000004").iterdir()}
            assert names == {f"__{rank}_0.distcp", ".metadata", "isthmus.json"}, (folder, names)
            manifest = json.loads((folder / "a/checkpoints/step-000004/isthmus.json").read_text())
            assert manifest["hosts"] == ["host0", "host1"] and set(manifest["files"]) == names - {"isthmus.json"}

        # A restart on the same hosts at the same layout: the losses of the uninterrupted run.
        # It saves asynchronously: each host's folder is committed from the checkpointer's thread.
        resume = ["--checkpoint.resume", str(runs / "a/checkpoints/step-000004"), "--checkpoint.async_save", "true"]
        second = _start(hosts, runs, own, "b", *resume)
        # Meanwhile one process on host 0 (world 1) resumes it too: it would need host 1's shards.
        argv = [sys.executable, "-m", "isthmus", "train", *B, "--train.run_dir", str(runs / "c")]
        argv += ["--checkpoint.resume", str(runs / "a/checkpoints/step-000004")]
        alone = hosts.popen(0, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait(second, lambda: 8 in _losses(runs / "b/metrics.jsonl"))
        expected, resumed = _losses(runs / "a/metrics.jsonl"), _losses(runs / "b/metrics.jsonl")
        assert min(resumed) == 5
        for step in range(5, 9):
            assert resumed[step] == expected[step], (step, resumed[step], expected[step])
        b8 = "b/checkpoints/step-000008"
        _wait(second, lambda: (runs / b8 / "isthmus.json").is_file() and (own / b8 / "isthmus.json").is_file())
        for folder, rank in ((runs, 0), (own, 1)):
            assert {p.name for p in (folder / b8).iterdir()} == {f"__{rank}_0.distcp", ".metadata", "isthmus.json"}

        # Host 1's only rank is stopped (not dead): both hosts end, each in one line naming it, exit 3.
        rank1 = holder_of(second[1].pid, runs / "b/logs/rank1.log")
        os.kill(rank1, signal.SIGSTOP)
        stopped_at = time.monotonic()
        ends = [p.communicate(timeout=90) for p in second]
        took = time.monotonic() - stopped_at
        for i, (p, (_, err)) in enumerate(zip(second, ends, strict=True)):
            lines = [line for line in err.splitlines() if line.startswith("isthmus:")]
            assert p.returncode == 3, (i, err[-3000:])
            assert len(lines) == 1, (i, err[-3000:])
            assert lines[0].startswith("isthmus: error: rank 1 on host1 stopped answering for "), lines
        assert gone(rank1, timeout=10)
        assert took < 60, took
        _, err = alone.communicate(timeout=60)  # long done
        assert hosts.pids(0) == [] and hosts.pids(1) == []
    # The single process was refused before any step, in one line.
    assert alone.returncode == 2, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"isthmus: error: {runs}/a/checkpoints/step-000004 on host0 lacks pieces of "), line
    assert "that rank 0 needs, saved on host1: a checkpoint in per-host folders resumes only on the hosts" in line
    assert _losses(runs / "c/metrics.jsonl") == {}


@pytest.mark.slow
def test_a_host_guard_ends_only_a_host_whose_every_rank_is_stopped(tmp_path: Path) -> None:
    """`HostGuard` (in `isthmus.launch.agent`): a running rank is left to end by itself; once every rank
    of the host is stopped, the line, SIGKILL and the job's code."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    running = subprocess.Popen(["sleep", "60"])
    stopped = subprocess.Popen(["sleep", "60"])
    os.kill(stopped.pid, signal.SIGSTOP)
    for rank, proc in enumerate((running, stopped)):
        body = {"pid": proc.pid, "host": "127.0.0.1", "port": store.port, "prefix": "job/"}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(body))
    end = JobEnd("stall", 1, "host1", 3, "rank 1 on host1 stopped answering for 9 s")
    dist.PrefixStore("job/", store).set(END_KEY, json.dumps(end.__dict__))
    console, codes = io.StringIO(), []
    try:
        HostGuard(tmp_path, console=console, exit_fn=codes.append).start()
        time.sleep(2.5)
        assert codes == [] and running.poll() is None and stopped.poll() is None  # one rank runs: not its business
        os.kill(running.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not codes and time.monotonic() < deadline:
            time.sleep(0.1)
        assert codes == [3]
        assert console.getvalue() == "isthmus: error: rank 1 on host1 stopped answering for 9 s\n"
        assert running.wait(5) == -signal.SIGKILL and stopped.wait(5) == -signal.SIGKILL
        assert not tmp_path.exists()  # its folder goes with it
    finally:
        for proc in (running, stopped):
            proc.kill()
            proc.wait()


def test_a_hosts_own_checkpoint_folder_is_locked_with_its_run_folder(tmp_path: Path) -> None:
    """A host's own ``checkpoint.dir`` is locked beside its run folder, in one claim released at once."""
    claim = lock_host_dir(tmp_path / "run").absorb(lock_host_dir(tmp_path / "ckpt", "checkpoint.dir"))
    try:
        with pytest.raises(Exception, match=rf"checkpoint.dir = '{tmp_path}/ckpt': is in use by a live run"):
            lock_host_dir(tmp_path / "ckpt", "checkpoint.dir")
    finally:
        claim.release()
    lock_host_dir(tmp_path / "ckpt", "checkpoint.dir").release()
    lock_host_dir(tmp_path / "run").release()
