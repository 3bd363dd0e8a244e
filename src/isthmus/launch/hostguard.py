"""A host's guard on a job of several hosts: ends the host when the job ended and every rank of it is stopped.

A stopped rank (SIGSTOP, a frozen process) runs nothing of ours: not even its `JobWatch` thread
(a stop halts every thread of a process), so it never learns that the job ended, and its host's
agent sees a live worker until the rendezvous host's store is gone. So something outside the
ranks watches them: the host's ranks name themselves in a folder (``rank<N>.json``: pid, start
time, the job's store), and once the job's end is posted there and the host's ranks are all stopped
on two reads in a row, the guard says the end's line, SIGKILLs them and is done, while the
rendezvous host's store is still up. A rank that runs ends by itself (`JobWatch`); it is left alone.

The guard runs

- under the emulated hosts' agent (`isthmus.launch.agent`), as a thread of the agent, for the folder
  it names in ``$ISTHMUS_AGENT_DIR``; it exits the agent with the end's code;
- under torch's own agent (torchrun), which has no hook for it, as a small process that each host's
  local rank 0 starts (`start_guard`; ``python -m isthmus.launch.hostguard FOLDER``), for a private
  folder the host's ranks find by the job's store address (`guard_folder`). It runs in a session of
  its own, so a stop or a Ctrl-C sent to the ranks does not reach it; it exits once its host's ranks
  are all gone (their end, a Ctrl-C, a SIGKILL), and removes its folder. Its agent then sees a worker
  killed and exits 1, as torchrun does for any failed worker.

Only the standard library loads at import: torch, for the store's client, once every rank of the
host is stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

END_KEY = "end"
POLL_S = 0.5
"""How often a rank reads ``end``, and a guard its ranks' state: each must know the reason before
the store is gone. The rendezvous host's agent, `isthmus.launch.agent`, stays 3 s after a failure;
torchrun's own exits as soon as its ranks are gone, which for a frozen peer's stall is
`jobwatch.STUCK_GRACE_S` after the end was posted (its ranks wait in the peer's collective), and the
frozen host's guard ends its ranks within a poll of the post (dev/LOG.md)."""


@dataclass(frozen=True)
class JobEnd:
    """Why a job on several hosts ends, as the rank that knew it posted it."""

    kind: str
    """``signal``, ``stall``, ``error`` or ``lost``."""
    rank: int
    host: str
    code: int
    """The exit code every rank ends with (`isthmus.errors`; 128 + N for signal N)."""
    line: str
    """What happened, naming the rank and host (``rank 3 on host1 stopped answering for 31 s ...``)."""


def end_line(end: JobEnd) -> str:
    """The one line a host says for the job's end: ``isthmus: error: rank 1 on host1 stopped ...``."""
    return f"isthmus: {'' if end.kind == 'signal' else 'error: '}{end.line}"


def parse_end(raw: Any) -> JobEnd | None:
    try:
        text = bytes(raw).decode() if not isinstance(raw, str) else raw
        return JobEnd(**json.loads(text)) if text else None
    except (ValueError, TypeError):
        return None


def store_client(host: str, port: int, prefix: str) -> Any:
    """A client of the job's store at ``host:port``, under ``prefix``."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False)
    return dist.PrefixStore(prefix, store)


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command's name (state first), or None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot): with the pid, it names one process."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def _stopped(pid: int, started: int | None = None) -> bool | None:
    """Whether process ``pid`` is stopped (True), runs (False), or is gone (None: also when it is
    another process by now, one that did not start at ``started``)."""
    fields = _proc_stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    if started is not None and len(fields) > 19 and int(fields[19]) != started:
        return None
    return fields[0] in ("T", "t")


class HostGuard:
    """Ends the host when the job ended and every rank of the host is stopped (see the module doc):
    reads the ranks' files in ``folder`` and the job's ``end``.

    ``until_ranks_gone``: :meth:`run` returns once the host's ranks are all gone (the guard process);
    otherwise it waits for the next ranks (the agent's thread: torch's agent may restart them)."""

    def __init__(
        self,
        folder: Path,
        console: Any = None,
        exit_fn: Any = os._exit,
        kill: Any = os.kill,
        *,
        until_ranks_gone: bool = False,
    ) -> None:
        self.folder, self.console, self.exit_fn, self.kill = folder, console or sys.stderr, exit_fn, kill
        self.until_ranks_gone = until_ranks_gone
        self._thread = threading.Thread(target=self._run_in_agent, name="isthmus-host-guard", daemon=True)

    def start(self) -> None:
        """Run in a thread of this process (an agent's); it exits the process with the end's code."""
        self._thread.start()

    def _run_in_agent(self) -> None:
        end = self.run()
        if end is not None:
            shutil.rmtree(self.folder, ignore_errors=True)  # the agent's own cleanup does not run after exit_fn
            self.exit_fn(end.code)

    def _ranks(self) -> list[dict[str, Any]]:
        found = []
        for path in sorted(self.folder.glob("rank*.json")):
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        return found

    def run(self) -> JobEnd | None:
        """Watch until the host is ended (returns the job's end) or, ``until_ranks_gone``, until its
        ranks are all gone (returns None)."""
        stores: dict[tuple[str, int, str], Any] = {}
        ends: dict[tuple[str, int, str], JobEnd] = {}  # the first end posted stands: once read, kept
        stopped_before = False
        while True:
            time.sleep(POLL_S)
            ranks = [r for r in self._ranks() if _stopped(r["pid"], r.get("start")) is not None]
            if not ranks:
                if self.until_ranks_gone:
                    return None
                stopped_before = False
                continue
            # Ranks that run end by themselves (`JobWatch`); stopped ones never will.
            if not all(_stopped(r["pid"], r.get("start")) for r in ranks):
                stopped_before = False
                continue
            where_ = (ranks[0]["host"], ranks[0]["port"], ranks[0]["prefix"])
            if where_ not in ends:
                try:
                    if where_ not in stores:
                        stores[where_] = store_client(*where_)
                    store = stores[where_]
                    end = parse_end(store.get(END_KEY)) if store.check([END_KEY]) else None
                except Exception:  # the store is gone (or not reached this time): a new client next time
                    stores.pop(where_, None)
                    end = None
                if end is not None:
                    ends[where_] = end
            if where_ in ends and stopped_before:
                self._end_host(ends[where_], [r["pid"] for r in ranks])
                return ends[where_]
            stopped_before = True

    def _end_host(self, end: JobEnd, pids: list[int]) -> None:
        self.console.write(end_line(end) + "\n")
        self.console.flush()
        for pid in pids:
            try:
                self.kill(pid, signal.SIGKILL)  # a stopped process takes no other signal before it runs again
            except OSError:
                pass


def guard_folder(store: tuple[str, int, str]) -> Path | None:
    """This host's guard folder for the job attempt whose store is ``store`` (host, port, prefix): the
    same path for every rank of the host, made private to this user; None when it cannot be (a
    folder by that name that is not ours)."""
    key = json.dumps([os.getuid(), socket.gethostname(), *store]).encode()
    folder = Path(tempfile.gettempdir()) / f"isthmus-guard-{hashlib.sha256(key).hexdigest()[:16]}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = folder.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        return None
    return folder


def start_guard(folder: Path, stderr: Any = None) -> subprocess.Popen[bytes]:
    """Start this host's guard process for ``folder``, in a session of its own; its line goes to
    ``stderr`` (default: this process's, the host's console)."""
    return subprocess.Popen(
        [sys.executable, "-m", "isthmus.launch.hostguard", str(folder)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        start_new_session=True,
    )


def main(argv: list[str]) -> int:
    folder = Path(argv[0])

    def leave(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    # The store's client warns on the host's console (this process's stderr) whenever the store is
    # gone; the guard's only line is the job's end.
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    # A scheduler's stop of the whole job (scancel) reaches this process too: the folder still goes.
    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, leave)
    try:
        end = HostGuard(folder, until_ranks_gone=True).run()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0 if end is None else end.code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
