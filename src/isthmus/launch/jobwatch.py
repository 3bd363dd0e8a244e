"""A job whose ranks span hosts, watched from inside its ranks: which host and rank stalled or stopped it.

Under ``torchrun`` on several nodes no isthmus launcher watches the ranks: each host's agent knows
only its own workers, and a rank whose peer on another host went away sees a collective fail (a
reset connection), or wait for the process-group timeout (a peer that lives but stopped), without
being told why. So every rank of such a job (``WORLD_SIZE`` > ``LOCAL_WORLD_SIZE``) runs a thread
on the job's store (MASTER_ADDR:MASTER_PORT: the rendezvous host's agent's, or rank 0's when torch
does not share the agent's; its own client, so it never waits behind the trainer's store calls):

- it beats: ``beat/<rank>`` holds its host, pid, last finished step and a counter it raises every
  beat interval. Only the counter's change is looked at, by the watcher's own clock: the hosts'
  clocks need not agree.
- each host's local rank 0 watches every beat: a rank whose counter has not moved for
  ``parallel.timeout_s`` stalled (its process stopped, or its host froze) and ends the job.
- the first rank that knows why the job ends posts it once, as ``end`` (compare-and-set: the first
  reason stands): a signal it got (``SIGTERM to rank 2 on host1``), a stall it found, an error of its
  own. Every rank reads ``end`` twice a second, so it still knows after the store's host is gone.
- a rank whose collective failed (the peers left) ends with that reason and its exit code; a rank
  blocked on a stalled peer cannot unwind, so its thread ends it (``os._exit``) with the reason's
  line. Each host's local rank 0 prints the one line, so every host's output says it once.

A rank that is gone before it could post (SIGKILL) leaves no reason: the others then say which host's
connection they lost. torch's agent has no such check (its health check is for the agent itself).

A host whose every rank is stopped (SIGSTOP, a frozen process) runs nothing of ours that could end it;
its agent would fail much later, when the rendezvous host's store is gone. `HostGuard` runs in the
emulated hosts' agent (`isthmus.launch.agent`), which knows its ranks from the files they leave in
``$ISTHMUS_AGENT_DIR``: once the job's end is posted and its ranks are all stopped (on two reads in
a row), it says the line, SIGKILLs them and exits with the end's code, while the rendezvous host's
store is still up (its agent stays `STORE_GRACE_S` after its own ranks ended). torchrun's own
agent has no such hook.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from isthmus.launch.environ import AGENT_DIR_ENV, where
from isthmus.launch.heartbeat import beat_interval
from isthmus.parallel.rendezvous import store_address

END_KEY = "end"
POLL_S = 0.5
"""How often a rank reads ``end``: it must know the reason before the store is gone (the rendezvous
host's agent, `isthmus.launch.agent`, stays 3 s after a failure)."""
STUCK_GRACE_S = 5.0
"""How long a rank has, after the job's end was posted, to unwind by itself before its thread ends it."""


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


class JobWatch:
    """This rank's beat and watch on the job's store, in a daemon thread from :meth:`start` to :meth:`stop`."""

    def __init__(
        self,
        rank: int,
        world: int,
        step: Any,
        timeout_s: float,
        *,
        watcher: bool,
        store: Any = None,
        host: str | None = None,
        exit_fn: Any = os._exit,
        console: Any = None,
    ) -> None:
        """``step``: a callable, this rank's last finished step. ``watcher``: whether this rank looks for
        stalled ranks (each host's local rank 0). ``store``: the job's store (default: a client of
        MASTER_ADDR:MASTER_PORT under this attempt's prefix). ``console``: where this rank's thread
        prints the one line when it ends the rank itself (None: it does not print)."""
        self.rank, self.world, self.step, self.timeout_s = rank, world, step, timeout_s
        self.watcher, self.host = watcher, host or socket.gethostname()
        self.exit_fn, self.console = exit_fn, console
        self.store = store if store is not None else _job_store()
        self.end: JobEnd | None = None
        """The job's end once any rank posted it (this one included)."""
        self._lock = threading.RLock()
        self._count = 0
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (its counter, when it last moved, by our clock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="isthmus-job-watch", daemon=True)

    def start(self) -> None:
        self._beat()
        self._thread.start()
        _tell_agent(self.rank)

    def stop(self, done: bool = True) -> None:
        """Stop beating; ``done``: this rank finished, and no watcher must take its silence for a stall."""
        self._stop.set()
        self._thread.join(timeout=5)
        if done:
            self._beat(done=True)

    def post(self, end: JobEnd) -> JobEnd:
        """Post ``end`` unless another rank posted one first; returns the end that stands."""
        body = json.dumps(asdict(end))
        try:
            with self._lock:
                stood = self.store.compare_set(END_KEY, "", body)
            self.end = _parse(stood) or end
        except Exception:  # the store's host is gone: this rank's own reason is what it knows
            self.end = self.end or end
        return self.end

    def wait_for_end(self, timeout_s: float) -> JobEnd | None:
        """The job's end, waiting up to ``timeout_s`` for a rank to post it (after a collective failed,
        the rank that knows why may be a moment behind)."""
        deadline = time.monotonic() + timeout_s
        while self.end is None and time.monotonic() < deadline:
            self._read_end()
            if self.end is None:
                time.sleep(POLL_S)
        return self.end

    # --- the thread -------------------------------------------------------------------
    def _run(self) -> None:
        interval = beat_interval(self.timeout_s)
        next_beat = time.monotonic() + interval
        ended_at: float | None = None
        while not self._stop.wait(min(POLL_S, interval)):
            try:
                if self.end is None:
                    self._read_end()
                now = time.monotonic()
                if self.end is None and now >= next_beat:
                    next_beat = now + interval
                    self._beat()
                    if self.watcher:
                        self._look_for_stalls(now)
            except Exception:  # the store's host is gone: the ranks' own collectives fail and say so
                pass
            if self.end is not None:
                ended_at = ended_at or time.monotonic()
                if time.monotonic() - ended_at >= STUCK_GRACE_S:
                    self._end_stuck_rank(self.end)
                    return

    def _beat(self, done: bool = False) -> None:
        self._count += 1
        body = {"host": self.host, "pid": os.getpid(), "step": int(self.step()), "n": self._count, "done": done}
        try:
            with self._lock:
                self.store.set(f"beat/{self.rank}", json.dumps(body))
        except Exception:
            pass  # a beat that cannot be written is a beat missed: what the watchers report

    def _read_end(self) -> None:
        with self._lock:
            if not self.store.check([END_KEY]):
                return
            self.end = _parse(self.store.get(END_KEY))

    def _look_for_stalls(self, now: float) -> None:
        keys = [f"beat/{r}" for r in range(self.world)]
        with self._lock:  # one round trip once every rank has beaten
            present = keys if self.store.check(keys) else [k for k in keys if self.store.check([k])]
            values = self.store.multi_get(present) if present else []
        for key, value in zip(present, values, strict=True):
            rank = int(key.split("/")[1])
            beat = json.loads(bytes(value).decode())
            if beat.get("done"):
                self._seen.pop(rank, None)
                continue
            count, moved = self._seen.get(rank, (-1, now))
            if beat["n"] != count:
                self._seen[rank] = (beat["n"], now)
            elif now - moved >= self.timeout_s:
                line = (
                    f"{where(rank, beat['host'])} stopped answering for {now - moved:.0f} s (last step it finished: "
                    f"{beat['step']}); stopped every rank (parallel.timeout_s = {self.timeout_s:g})"
                )
                self.post(JobEnd("stall", rank, beat["host"], 3, line))
                return

    def _end_stuck_rank(self, end: JobEnd) -> None:
        """The job ended and this rank did not: it waits on a peer that cannot answer. Say it and exit."""
        if self.console is not None:
            self.console.write(f"isthmus: {_prefix(end)}{end.line}\n")
            self.console.flush()
        self.exit_fn(end.code)


def _prefix(end: JobEnd) -> str:
    return "" if end.kind == "signal" else "error: "


def _parse(raw: Any) -> JobEnd | None:
    try:
        text = bytes(raw).decode() if not isinstance(raw, str) else raw
        return JobEnd(**json.loads(text)) if text else None
    except (ValueError, TypeError):
        return None


JOB_TOKEN_ENV = "ISTHMUS_JOB_TOKEN"
"""This attempt's token, rank 0's, which every rank learned when the run directory was claimed."""


def _job_store_address() -> tuple[str, int, str]:
    """The job's store (torchrun's, at MASTER_ADDR:MASTER_PORT) and this attempt's prefix there: rank
    0's token, the same on every host (agents count their restarts each their own way: a host that
    rejoins an elastic job starts again at 0)."""
    host, port = store_address()
    attempt = os.environ.get(JOB_TOKEN_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return host, port, f"isthmus/watch/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/{attempt}/"


def _client(host: str, port: int, prefix: str) -> Any:
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False)
    return dist.PrefixStore(prefix, store)


def _job_store() -> Any:
    """A client of the job's store, under this attempt's prefix (`_job_store_address`)."""
    return _client(*_job_store_address())


def _tell_agent(rank: int) -> None:
    """Leave this rank's pid and the job's store in the agent's folder, if the agent has one."""
    folder = os.environ.get(AGENT_DIR_ENV)
    if not folder:
        return
    host, port, prefix = _job_store_address()
    body = json.dumps({"pid": os.getpid(), "host": host, "port": port, "prefix": prefix})
    try:
        tmp = Path(folder) / f".rank{rank}.{os.getpid()}"
        tmp.write_text(body)
        tmp.replace(Path(folder) / f"rank{rank}.json")
    except OSError:
        pass  # the agent is gone: nothing to tell


def _stopped(pid: int) -> bool | None:
    """Whether process ``pid`` is stopped (True), runs (False), or is gone (None)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return None if state in ("Z", "X") else state in ("T", "t")


class HostGuard:
    """In a host's agent: ends the host when the job ended and every rank of the host is stopped
    (see the module doc). Its thread reads the ranks' files in ``folder`` and the job's ``end``."""

    def __init__(self, folder: Path, console: Any = None, exit_fn: Any = os._exit, kill: Any = os.kill) -> None:
        self.folder, self.console, self.exit_fn, self.kill = folder, console or sys.stderr, exit_fn, kill
        self._thread = threading.Thread(target=self._run, name="isthmus-host-guard", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _ranks(self) -> list[dict[str, Any]]:
        found = []
        for path in sorted(self.folder.glob("rank*.json")):
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        return found

    def _run(self) -> None:
        stores: dict[tuple[str, int, str], Any] = {}
        stopped_before = False
        while True:
            time.sleep(POLL_S)
            ranks = [r for r in self._ranks() if _stopped(r["pid"]) is not None]
            if not ranks:
                continue
            where_ = (ranks[0]["host"], ranks[0]["port"], ranks[0]["prefix"])
            try:
                if where_ not in stores:
                    stores[where_] = _client(*where_)
                store = stores[where_]
                end = _parse(store.get(END_KEY)) if store.check([END_KEY]) else None
            except Exception:  # no store yet, or gone: the ranks' own ways out stand
                continue
            if end is None:
                continue
            # Ranks that run end by themselves (`JobWatch`); stopped ones never will.
            stopped = all(_stopped(r["pid"]) for r in ranks)
            if stopped and stopped_before:
                self._end_host(end, [r["pid"] for r in ranks])
                return
            stopped_before = stopped

    def _end_host(self, end: JobEnd, pids: list[int]) -> None:
        self.console.write(f"isthmus: {_prefix(end)}{end.line}\n")
        self.console.flush()
        for pid in pids:
            try:
                self.kill(pid, 9)  # SIGKILL: a stopped process takes no other signal before it runs again
            except OSError:
                pass
        shutil.rmtree(self.folder, ignore_errors=True)  # the agent's own cleanup does not run after exit_fn
        self.exit_fn(end.code)
