"""Which rank stopped answering: each rank's heartbeat file, and the launcher's monitor that reads them.

A thread in every rank rewrites ``rank<N>.beat`` (its pid, the last step it finished, the time)
every ``interval`` seconds. A thread, not the training loop: a rank blocked in a collective
waiting for a stalled peer still beats, so the one that falls silent is the one whose process
stopped (SIGSTOP, a frozen machine, a process swapped out), not one that waits for it. The
launcher's :class:`StallMonitor` finds a rank silent for ``parallel.timeout_s``, names it, and
kills every rank (SIGKILL: a stopped process ignores every other signal until it is continued).

torch's elastic agent has no such check (its health check is for the agent itself), and the
process-group timeout makes the waiting ranks fail, without naming the one they waited for.
The files live in the launch's own temporary directory, not in the run directory: a full disk
there must not silence them.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from isthmus.train.trainer import Progress


@dataclass(frozen=True)
class Beat:
    rank: int
    pid: int
    step: int
    time: float


@dataclass(frozen=True)
class Stall:
    """A rank that stopped answering."""

    rank: int
    silent_s: float
    step: int


def beat_interval(timeout_s: float) -> float:
    """Often enough that a silence of ``timeout_s`` is seen within a tenth of it (at most every second)."""
    return min(1.0, timeout_s / 10)


class Heartbeat:
    """This rank's beat, written by a daemon thread until :meth:`stop`."""

    def __init__(self, path: Path, rank: int, progress: Progress, interval: float) -> None:
        self.path, self.rank, self.progress, self.interval = path, rank, progress, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="isthmus-heartbeat", daemon=True)

    def start(self) -> None:
        self._write()
        self._thread.start()

    def stop(self) -> None:
        """Stop beating, after a last beat with the last step (what the launcher reports)."""
        self._stop.set()
        self.progress.changed.set()
        self._thread.join(timeout=5)
        self._write()

    def _run(self) -> None:
        # Every interval, and at once when a step finished: the step a stalled rank reports is its last.
        while not self._stop.is_set():
            self.progress.changed.wait(self.interval)
            self.progress.changed.clear()
            self._write()

    def _write(self) -> None:
        body = json.dumps({"rank": self.rank, "pid": os.getpid(), "step": self.progress.step, "time": time.time()})
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(body)
            tmp.replace(self.path)  # the monitor never reads half a beat
        except OSError:
            pass  # a beat that cannot be written now is written next time; a missing beat is what we report


def read_beats(directory: Path) -> list[Beat]:
    """The newest beat of every rank that wrote one, by rank."""
    beats = []
    for path in directory.glob("rank*.beat"):
        try:
            b = json.loads(path.read_text())
            beats.append(Beat(int(b["rank"]), int(b["pid"]), int(b["step"]), float(b["time"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(beats, key=lambda b: b.rank)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a stopped one counts; a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class StallMonitor:
    """The launcher's thread: a rank whose process lives but has not beaten for ``timeout_s`` stalled."""

    def __init__(self, directory: Path, timeout_s: float) -> None:
        self.directory, self.timeout_s = directory, timeout_s
        self.stall: Stall | None = None
        self._killed: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="isthmus-stall-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(beat_interval(self.timeout_s)):
            self.check(time.time())

    def check(self, now: float) -> Stall | None:
        """Look once; on a stall, remember it and kill every rank (restarts, if any, are the agent's)."""
        beats = [b for b in read_beats(self.directory) if b.pid not in self._killed and _alive(b.pid)]
        silent = [b for b in beats if now - b.time >= self.timeout_s]
        if not silent:
            return None
        first = min(silent, key=lambda b: b.time)
        self.stall = Stall(first.rank, now - first.time, first.step)
        for b in beats:
            self._killed.add(b.pid)
            try:
                os.kill(b.pid, signal.SIGKILL)
            except OSError:
                pass
        return self.stall
