"""Real `isthmus` processes for the tests: run a command as a user types it, start a training run and
wait for a step, find a rank, read a failure's last line.

No test hook in the library: a rank is found in the process tree by the log file it holds open,
and a run's progress by its ``metrics.jsonl``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import isthmus
from isthmus.launch.local import last_logged_step


def tiny_run(steps: int, batch_size: int = 8) -> list[str]:
    """A short run of the tiny config on a small slice of the default corpus, without validation."""
    return [
        *("--config", "tiny", "--train.steps", str(steps), "--train.val_every", "0"),
        *("--train.batch_size", str(batch_size), "--train.seq_len", "32", "--data.max_bytes", "60000"),
    ]


# A tiny run that never ends by itself (the tests stop it).
BASE_ARGS = [*tiny_run(100000), "--metrics.log_every", "1000"]


def isthmus_argv(*args: str) -> list[str]:
    """``isthmus ARGS`` as this interpreter runs it (the installed script may belong to another venv),
    told to stop (SIGTERM) when the test process dies: a suite stopped by ``timeout`` or a kill leaves
    no run of its own behind (util-linux's setpriv sets the death signal and execs the command, so
    the pid is the command's)."""
    die_with_us = ["setpriv", "--pdeathsig", "TERM", "--"] if shutil.which("setpriv") else []
    return [*die_with_us, sys.executable, "-m", "isthmus", *args]


def run_isthmus(
    *args: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """Run ``isthmus ARGS`` to its end, its output captured as text; ``env`` adds to this process's
    environment. No terminal on stdin, as under CI."""
    # The isthmus under test, whatever directory the command runs in (an editable install finds it
    # anyway; a checkout tested through PYTHONPATH does not).
    src = str(Path(isthmus.__file__).resolve().parents[1])
    path = os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run(
        isthmus_argv(*args),
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


class Train:
    """`python -m isthmus train` in a subprocess, in a session of its own (as a shell job is)."""

    def __init__(self, run_dir: Path, cache: Path, *extra: str, base: list[str] = BASE_ARGS) -> None:
        self.dir = run_dir
        args = [*base, "--train.run_dir", str(run_dir), "--data.cache_dir", str(cache), *extra]
        self.proc = subprocess.Popen(
            isthmus_argv("train", *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.code: int | None = None
        self.err = ""

    @property
    def metrics(self) -> Path:
        return self.dir / "metrics.jsonl"

    def wait_for_step(self, step: int, timeout: float = 300) -> int:
        """Block until the run has logged ``step``; returns the step it logged last."""
        deadline = time.monotonic() + timeout
        while (last := last_logged_step(self.metrics)) < step:
            assert self.proc.poll() is None, f"the run ended before step {step}: {self.proc.communicate()[1][-3000:]}"
            assert time.monotonic() < deadline, f"the run never reached step {step}"
            time.sleep(0.01)
        return last

    def rank_pid(self, rank: int) -> int:
        return holder_of(self.proc.pid, self.dir / "logs" / f"rank{rank}.log")

    def wait(self, timeout: float = 300) -> tuple[int, str]:
        _, self.err = self.proc.communicate(timeout=timeout)
        self.code = self.proc.returncode
        return self.code, self.err


def descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def holder_of(root: int, path: Path) -> int:
    """The process under ``root`` that has ``path`` open (each rank holds its own log file)."""
    for pid in descendants(root):
        try:
            if any(os.readlink(fd) == str(path) for fd in Path(f"/proc/{pid}/fd").iterdir()):
                return pid
        except OSError:
            continue
    raise AssertionError(f"no process under {root} holds {path}")


def gone(pid: int, timeout: float = 10) -> bool:
    """Whether ``pid`` has exited (a zombie counts as gone) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def session_pids(sid: int) -> list[int]:
    """Every live process of session ``sid`` (a run started in a session of its own: its launcher, the
    rank server, the resource tracker, the ranks); zombies are gone."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def session_gone(sid: int, timeout: float = 10) -> list[int]:
    """Wait up to ``timeout`` seconds for session ``sid`` to have no live process; returns those left."""
    deadline = time.monotonic() + timeout
    while (left := session_pids(sid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def shm_files(pids: list[int]) -> set[Path]:
    """The files in /dev/shm that any of ``pids`` has mapped (multiprocessing's named semaphores, shared
    memory collectives' buffers) and that still exist."""
    found = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/") and not fields[5].endswith("(deleted)"):
                found.add(Path(fields[5]))
    return found


def last_line(err: str) -> str:
    """The one line a failure ends in; asserts nothing else on stderr looks like an error or a traceback."""
    lines = err.rstrip().splitlines()
    assert lines, "nothing on stderr"
    assert "Traceback" not in err, err[-3000:]
    noise = [
        line for line in lines[:-1] if line.startswith("isthmus:") or "error" in line.lower() or "warn" in line.lower()
    ]
    assert not noise, noise
    return lines[-1]


needs_hosts = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None,
    reason="emulated hosts need root, iproute2 and unshare",
)
"""Mark of a test that runs on :class:`isthmus.launch.hosts.EmulatedHosts`."""
