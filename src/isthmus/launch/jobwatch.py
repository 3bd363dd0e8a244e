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

A host whose every rank is stopped (SIGSTOP, a frozen process) runs nothing of ours that could end
it: `isthmus.launch.hostguard` watches such a host from outside its ranks, which name themselves to
it when their watch starts (`_tell_guard`): the emulated hosts' agent (`isthmus.launch.agent`) runs
the guard, under torch's own agent each host's local rank 0 starts it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from isthmus.launch.environ import AGENT_DIR_ENV, spans_hosts, where
from isthmus.launch.heartbeat import beat_interval
from isthmus.launch.hostguard import (
    END_KEY,
    POLL_S,
    HostGuard,
    JobEnd,
    end_line,
    guard_folder,
    parse_end,
    start_guard,
    start_time,
    store_client,
)
from isthmus.launch.stop import STOP_SIGNALS
from isthmus.parallel.rendezvous import store_address

__all__ = ["END_KEY", "JOB_TOKEN_ENV", "HostGuard", "JobEnd", "JobWatch"]
STUCK_GRACE_S = 5.0
"""How long a rank has, after the job's end was posted, to unwind by itself before its thread ends it."""
SIGNAL_GRACE_S = 1.0
"""How long a stop signal may wait for the main thread's handler before this rank's thread posts it."""


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
        self.store_lost = False
        """Whether posting to the job's store failed (its host, the rendezvous host, is gone)."""
        self._lock = threading.RLock()
        self._count = 0
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (its counter, when it last moved, by our clock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="isthmus-job-watch", daemon=True)
        self._wake: tuple[int, int, int] | None = None  # (read end, write end, the wake-up fd before)
        self._handled: Callable[[], bool] = lambda: True
        self._signalled: tuple[int, float] | None = None  # (signal, when this thread saw it)

    def start(self) -> None:
        self._beat()
        self._thread.start()
        _tell_guard(self.rank)

    def take_signals(self, handled: Callable[[], bool]) -> None:
        """From the main thread: post a stop signal that its handler could not take. Python runs signal
        handlers between bytecodes of the main thread only, so a rank blocked in a collective on a
        peer that stopped (a frozen host) never runs its handler: the job would wait for torch's
        agent to kill it, with no line. The interpreter's C-level handler still writes the signal's
        number to the wake-up fd; this rank's thread reads it there and, when ``handled()`` stays
        false for SIGNAL_GRACE_S, posts the signal as the job's end, which then ends this rank."""
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        self._wake = (read, write, signal.set_wakeup_fd(write, warn_on_full_buffer=False))
        self._handled = handled

    def stop(self, done: bool = True) -> None:
        """Stop beating; ``done``: this rank finished, and no watcher must take its silence for a stall."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self._wake is not None and threading.current_thread() is threading.main_thread():
            read, write, before = self._wake
            signal.set_wakeup_fd(before)
            os.close(read)
            os.close(write)
            self._wake = None
        if done:
            self._beat(done=True)

    def post(self, end: JobEnd) -> JobEnd:
        """Post ``end`` unless another rank posted one first; returns the end that stands."""
        body = json.dumps(asdict(end))
        try:
            with self._lock:
                stood = self.store.compare_set(END_KEY, "", body)
            self.end = parse_end(stood) or end
        except Exception:  # the store's host is gone: this rank's own reason is what it knows
            self.store_lost = True
            self.end = self.end or end
        return self.end

    def wait_for_end(self, timeout_s: float) -> JobEnd | None:
        """The job's end, waiting up to ``timeout_s`` for a rank to post it (after a collective failed,
        the rank that knows why may be a moment behind)."""
        deadline = time.monotonic() + timeout_s
        while self.end is None and time.monotonic() < deadline:
            try:
                self._read_end()
            except Exception:  # the store's host is gone: no rank can post there any more
                self.store_lost = True
                break
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
                if self.end is None:
                    self._post_unhandled_signal(now)
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

    def _post_unhandled_signal(self, now: float) -> None:
        """A stop signal the main thread has not handled within SIGNAL_GRACE_S (`take_signals`)."""
        if self._wake is None:
            return
        try:
            got = os.read(self._wake[0], 64)
        except (BlockingIOError, OSError):
            got = b""
        stops = [n for n in got if n in STOP_SIGNALS]
        if stops and self._signalled is None:
            self._signalled = (stops[0], now)
        if self._signalled is None or self._handled():
            return
        signum, seen = self._signalled
        if now - seen >= SIGNAL_GRACE_S:
            cause = f"{signal.Signals(signum).name} to {where(self.rank, self.host)}"
            self.post(JobEnd("signal", self.rank, self.host, 128 + signum, cause))

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
            self.end = parse_end(self.store.get(END_KEY))

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
            self.console.write(end_line(end) + "\n")
            self.console.flush()
        self.exit_fn(end.code)


JOB_TOKEN_ENV = "ISTHMUS_JOB_TOKEN"
"""This attempt's token, rank 0's, which every rank learned when the run directory was claimed."""


def _job_store_address() -> tuple[str, int, str]:
    """The job's store (torchrun's, at MASTER_ADDR:MASTER_PORT) and this attempt's prefix there: rank
    0's token, the same on every host (agents count their restarts each their own way: a host that
    rejoins an elastic job starts again at 0)."""
    host, port = store_address()
    attempt = os.environ.get(JOB_TOKEN_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return host, port, f"isthmus/watch/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/{attempt}/"


def _job_store() -> Any:
    """A client of the job's store, under this attempt's prefix (`_job_store_address`)."""
    return store_client(*_job_store_address())


def _under_torch_agent() -> bool:
    """Whether this rank's agent is torch's own (torchrun), not the emulated hosts' (`isthmus.launch.agent`)."""
    return spans_hosts() and "TORCHELASTIC_RUN_ID" in os.environ and not os.environ.get(AGENT_DIR_ENV)


def _tell_guard(rank: int) -> None:
    """Leave this rank's pid and the job's store where its host's guard reads them (`HostGuard`): in
    the agent's folder if the agent has one; under torch's agent in the host's guard folder, whose
    guard the host's local rank 0 starts."""
    given = os.environ.get(AGENT_DIR_ENV)
    if not given and not _under_torch_agent():
        return
    host, port, prefix = _job_store_address()
    folder = Path(given) if given else guard_folder((host, port, prefix))
    if folder is None:
        return
    body = json.dumps(
        {"pid": os.getpid(), "start": start_time(os.getpid()), "host": host, "port": port, "prefix": prefix}
    )
    try:
        tmp = folder / f".rank{rank}.{os.getpid()}"
        tmp.write_text(body)
        tmp.replace(folder / f"rank{rank}.json")
    except OSError:
        return  # the agent is gone: nothing to tell
    if not given and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        start_guard(folder)
