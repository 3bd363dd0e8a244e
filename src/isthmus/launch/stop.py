"""Stopping a run on SIGINT (Ctrl-C), SIGTERM or SIGHUP: one line that says where it stopped and how to go on.

The first signal raises :class:`Stopped` in the main thread, so the trainer unwinds as after any
failure (a checkpoint save in flight stays uncommitted, metrics are closed) and the process exits
with 128 + the signal's number. A second signal while that runs exits at once: the user insists.

Under the local launcher torch's agent catches the launcher's signal, sends the same signal to
every rank and waits for them (`isthmus.launch.local.SHUTDOWN_GRACE_S`) before it kills those still
running; each rank stops as above, quietly, and the launcher prints the line.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from isthmus.checkpoint.manifest import resume_note

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Ctrl-C, a stop from ``kill``, ``timeout``, systemd or Slurm, and a terminal that closed."""


class Stopped(BaseException):
    """Raised by the first of :data:`STOP_SIGNALS`. A BaseException, as KeyboardInterrupt is, so that no
    ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@dataclass
class StopState:
    signum: int | None = None
    """The signal that stopped this process, once one came."""


@contextmanager
def stop_on_signals(on_stop: Callable[[], None] | None = None) -> Iterator[StopState]:
    """Within the block, :data:`STOP_SIGNALS` raise :class:`Stopped` (main thread only, as Python's
    signal handlers are), after calling ``on_stop``; the handlers before it are put back after."""
    state = StopState()

    def handler(signum: int, frame: FrameType | None) -> None:
        if state.signum is not None:
            os._exit(128 + state.signum)
        state.signum = signum
        if on_stop is not None:
            on_stop()
        raise Stopped(signum)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield state
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def interrupted_line(signum: int, step: int, checkpoint_root: Path, every: int, cause: str | None = None) -> str:
    """``interrupted (SIGINT) at step 7; ...`` with what was saved and how to go on from it.
    ``cause`` says more than the signal's name (``SIGTERM to rank 2 on host1``)."""
    where = f"at step {step}" if step > 0 else "before the first step"
    return f"interrupted ({cause or signal.Signals(signum).name}) {where}; {resume_note(checkpoint_root, every)}"
