"""A job of several hosts under torch's own torchrun (``python -m torch.distributed.run``), as the README,
docs/many-nodes.md and examples/slurm/ run it: each host's guard process (`isthmus.launch.hostguard`).

Under torch's agent nothing of ours runs beside the ranks, so each host's local rank 0 starts a small
guard process: a host whose every rank is stopped (SIGSTOP, a frozen host) ends in the job's one
line, and the guard leaves with its host's ranks, whatever their end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from isthmus.launch.hostguard import END_KEY, JobEnd, start_guard, start_time
from isthmus.launch.hosts import EmulatedHosts, torchrun_argv
from procs import gone, needs_hosts

ARGS = ["--config", "tiny", "--train.val_every", "0", "--train.batch_size", "8", "--train.seq_len", "32"]
ARGS += ["--data.max_bytes", "60000", "--train.threads", "1", "--metrics.log_every", "1"]
ARGS += ["--parallel.dp_replicate", "2", "--parallel.timeout_s", "4"]


def _rank_file(folder: Path, rank: int, pid: int, port: int) -> None:
    """What a rank leaves for its host's guard (`jobwatch._tell_guard`)."""
    body = {"pid": pid, "start": start_time(pid), "host": "127.0.0.1", "port": port, "prefix": "job/"}
    (folder / f"rank{rank}.json").write_text(json.dumps(body))


@pytest.mark.slow
def test_a_guard_process_ends_a_stopped_host_and_leaves_with_its_ranks(tmp_path: Path) -> None:
    """The guard process: it waits while a rank runs; once the job's end is posted and its ranks are
    all stopped it says the line, SIGKILLs them and exits; otherwise it leaves when its ranks are
    gone. It removes its folder either way, and lives in a session of its own."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    sleeps: list[subprocess.Popen[bytes]] = []
    try:
        # A host whose ranks both end (a normal end, a Ctrl-C, a SIGKILL): the guard leaves with them.
        folder = tmp_path / "ended"
        folder.mkdir(mode=0o700)
        sleeps += [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
        for rank, proc in enumerate(sleeps):
            _rank_file(folder, rank, proc.pid, store.port)
        guard = start_guard(folder, stderr=subprocess.PIPE)
        assert os.getsid(guard.pid) == guard.pid  # a stop or Ctrl-C to the ranks' group does not reach it
        sleeps[0].kill()
        time.sleep(1.5)
        assert guard.poll() is None  # rank 1 still runs
        sleeps[1].kill()
        assert guard.wait(10) == 0
        assert guard.stderr is not None and guard.stderr.read() == b""
        assert not folder.exists()

        # A host whose ranks are all stopped as the job ends: the line, SIGKILL, the end's code.
        folder = tmp_path / "frozen"
        folder.mkdir(mode=0o700)
        frozen = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
        sleeps += frozen
        for rank, proc in enumerate(frozen):
            _rank_file(folder, rank, proc.pid, store.port)
            os.kill(proc.pid, signal.SIGSTOP)
        guard = start_guard(folder, stderr=subprocess.PIPE)
        time.sleep(1.5)
        assert guard.poll() is None and all(p.poll() is None for p in frozen)  # no end posted: not its business
        end = JobEnd("stall", 1, "host1", 3, "rank 1 on host1 stopped answering for 9 s")
        dist.PrefixStore("job/", store).set(END_KEY, json.dumps(end.__dict__))
        assert guard.wait(10) == 3
        assert guard.stderr is not None
        assert guard.stderr.read() == b"isthmus: error: rank 1 on host1 stopped answering for 9 s\n"
        assert all(p.wait(5) == -signal.SIGKILL for p in frozen)
        assert not folder.exists()
    finally:
        for proc in sleeps:
            proc.kill()
            proc.wait()


def _job(
    hosts: EmulatedHosts, logs: Path, name: str, target: list[str], env: dict[str, str]
) -> list[subprocess.Popen[str]]:
    """One torchrun of torch's own per host (c10d on host0), each host's output in ``logs/<name>-host<i>``."""
    argv = torchrun_argv(2, 1, "host0:29400", f"torchrun-{name}", target, agent="torch.distributed.run")
    procs = []
    for i in range(2):
        out = (logs / f"{name}-host{i}").open("w")
        procs.append(hosts.popen(i, argv, env=env, stdout=out, stderr=subprocess.STDOUT, text=True))
        out.close()
    return procs


def _training(
    hosts: EmulatedHosts, logs: Path, name: str, target: list[str], env: dict[str, str], run_dir: Path
) -> list[subprocess.Popen[str]]:
    """`_job`, returned once its first step is logged in ``run_dir``."""
    procs = _job(hosts, logs, name, [*target, "--train.run_dir", str(run_dir)], env)
    deadline = time.monotonic() + 120
    while _last_step(run_dir / "metrics.jsonl") < 1:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the run never trained"
        time.sleep(0.2)
    return procs


def _guards(hosts: EmulatedHosts, i: int) -> list[int]:
    """Host ``i``'s guard processes."""
    found = []
    for pid in hosts.pids(i):
        try:
            if b"isthmus.launch.hostguard" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


def _holder(hosts: EmulatedHosts, i: int, path: Path) -> int:
    """The process on host ``i`` that holds ``path`` open (each rank holds its own log file)."""
    for pid in hosts.pids(i):
        try:
            if any(os.readlink(fd) == str(path) for fd in Path(f"/proc/{pid}/fd").iterdir()):
                return pid
        except OSError:
            continue
    raise AssertionError(f"no process on host{i} holds {path}")


def _last_step(metrics: Path) -> int:
    try:
        return max((json.loads(line).get("step", 0) for line in metrics.read_text().splitlines()), default=0)
    except (OSError, ValueError):
        return 0


def _all_gone(hosts: EmulatedHosts, timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := hosts.pids(0) + hosts.pids(1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.slow
@needs_hosts
def test_a_frozen_host_under_torchrun_ends_in_one_line(tmp_path: Path) -> None:
    """2 hosts x 1 rank under torch's torchrun. A normal run: each host's guard leaves with its rank.
    Then host 1's rank is SIGSTOPped mid-run: the rank on host 0 names it after parallel.timeout_s,
    host 1's guard says the same line and SIGKILLs it while host 0's store is up, and each torchrun
    exits 1 (torch's code for a failed worker) without losing the rendezvous."""
    runs, logs, tmp = tmp_path / "runs", tmp_path / "logs", tmp_path / "tmp"
    for folder in (runs, logs, tmp):
        folder.mkdir()
    env = {"TMPDIR": str(tmp)}  # where the guards' folders are made
    target = ["-m", "isthmus", "train", *ARGS]
    with EmulatedHosts(2) as hosts:
        done = _job(hosts, logs, "done", [*target, "--train.steps", "1", "--train.run_dir", str(runs / "done")], env)
        for i, p in enumerate(done):
            assert p.wait(120) == 0, (logs / f"done-host{i}").read_text()[-3000:]
        assert _all_gone(hosts) == []
        assert list(tmp.glob("isthmus-guard-*")) == []

        frozen = _training(hosts, logs, "frozen", [*target, "--train.steps", "2000"], env, runs / "f")
        assert [len(_guards(hosts, i)) for i in range(2)] == [1, 1]  # one guard per host
        assert len(list(tmp.glob("isthmus-guard-*"))) == 2  # and its folder
        rank1 = _holder(hosts, 1, runs / "f/logs/rank1.log")
        os.kill(rank1, signal.SIGSTOP)
        stopped_at = time.monotonic()
        codes = [p.wait(90) for p in frozen]
        took = time.monotonic() - stopped_at
        outputs = [(logs / f"frozen-host{i}").read_text() for i in range(2)]
        for i, (code, out) in enumerate(zip(codes, outputs, strict=True)):
            lines = [line for line in out.splitlines() if line.startswith("isthmus:")]
            assert code == 1, (i, out[-3000:])
            assert len(lines) == 1, (i, out[-3000:])
            assert lines[0].startswith("isthmus: error: rank 1 on host1 stopped answering for "), lines
            assert "RendezvousConnectionError" not in out, (i, out[-3000:])
        assert gone(rank1)
        assert _all_gone(hosts) == []  # ranks, guards and agents
        assert list(tmp.glob("isthmus-guard-*")) == []
        assert took < 30, took

        # Host 1 frozen, then SIGTERM to host 0's torchrun (a cancelled job), long before any stall is
        # found: host 0's rank, blocked in a collective on host 1, cannot run its handler; its thread
        # posts the signal (`JobWatch.take_signals`), ends it, and host 1's guard says the same line.
        late = [*target, "--train.steps", "2000", "--parallel.timeout_s", "60"]
        signalled = _training(hosts, logs, "signalled", late, env, runs / "s")
        rank1 = _holder(hosts, 1, runs / "s/logs/rank1.log")
        os.kill(rank1, signal.SIGSTOP)
        time.sleep(1.0)  # host 0's rank is in its next collective by now
        signalled[0].send_signal(signal.SIGTERM)
        stopped_at = time.monotonic()
        codes = [p.wait(90) for p in signalled]
        took = time.monotonic() - stopped_at
        for i, code in enumerate(codes):
            out = (logs / f"signalled-host{i}").read_text()
            lines = [line for line in out.splitlines() if line.startswith("isthmus:")]
            # host 0 says it as its rank ends (``interrupted (SIGTERM to rank 0 on host0) at step N; ...``
            # when the handler ran), host 1's guard as the job's end
            assert code != 0 and len(lines) == 1 and "SIGTERM to rank 0 on host0" in lines[0], (i, code, out[-3000:])
        assert gone(rank1)
        assert _all_gone(hosts) == []
        assert list(tmp.glob("isthmus-guard-*")) == []
        assert took < 25, took  # torch's agent alone would wait 30 s, then kill without a line

        # The rendezvous host dies (every process on host 0 killed): host 1's agent loses the c10d
        # store that lived in host 0's agent; host 1's rank says so.
        headless = _training(hosts, logs, "headless", [*target, "--train.steps", "2000"], env, runs / "h")
        hosts.kill(0)
        code = headless[1].wait(90)
        headless[0].wait(10)
        out = (logs / "headless-host1").read_text()
        lines = [line for line in out.splitlines() if line.startswith("isthmus:")]
        assert code != 0 and len(lines) == 1, (code, out[-3000:])
        assert "rank 1 on host1 lost the job's other ranks and the job's store on " in lines[0], lines
        assert "(the rendezvous host)" in lines[0], lines
        assert _all_gone(hosts) == []
