"""Local ranks forked from an interpreter that has imported torch and isthmus once, not spawned to import them each.

Why: a spawned rank imports torch, DTensor, the pipelining schedules and the trainer itself, seconds
of one core, and every rank of a launch (and of each restart) pays it, after the launcher paid
it too. Python's forkserver with those modules preloaded pays it once: the launcher starts the server
as soon as it knows it will start ranks, before it imports the same modules itself, so both imports run
side by side; each rank is then a fork of a ready interpreter. A forkserver and not a fork of the
launcher: by the time the agent starts ranks the launcher runs threads (its rendezvous store, the
agent's keep-alive, the stall monitor) whose locks a fork would copy mid-use; the server is a single
thread that has run no torch operation (so no OpenMP pool to inherit either).

What the server cannot know: the environment. A forked rank starts with the server's, which is the
launcher's as it was when the server started; what the launcher sets afterwards for its ranks travels
to them as an argument (`isthmus.launch.local.run_rank`'s ``environ``).

Who can ask the server to fork: it listens on a Unix socket file of mode 0600 in a private temporary
directory, so only this user's processes (pyproject's Python >= 3.11.1: 3.11.0 put the socket in
Linux's abstract namespace, open to every local user, CVE-2022-42919).

How the server and its ranks end: the server outlives signals sent to the whole process group
(``timeout``, systemd and Slurm send SIGTERM so, a closing terminal SIGHUP; Python's server ignores
SIGINT itself), because a launcher that lost its server sees every rank as gone and would leave them
running. It exits when the launcher does (Python's server watches a pipe only the launcher holds),
and each rank dies with the server (`become_rank`): however the launcher ends, no rank outlives it.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import runpy
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

from isthmus.config import JobConfig
from isthmus.launch.environ import launcher_world

START_METHOD: Final = "forkserver"
RANK_MODULES = ("isthmus.launch.local", "isthmus.cli.main")
"""What a rank runs (`run_rank`, or the `isthmus` command) and everything it imports: torch,
torch.distributed, the trainer."""
GROUP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""What the server does not take from its process group (it ignores SIGINT by itself)."""
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def starts_local_ranks(cfg: JobConfig) -> bool:
    """Whether ``isthmus train`` with ``cfg`` starts ranks of its own (`isthmus.launch.local`):
    several ranks, or one with restarts, and no external launcher (torchrun) that started them."""
    return launcher_world() is None and (cfg.parallel.nproc > 1 or cfg.parallel.max_restarts > 0)


def rank_context() -> multiprocessing.context.ForkServerContext:
    """Processes forked from this process's server (its ``Process``, queues, events)."""
    return multiprocessing.get_context(START_METHOD)


def start_rank_server(modules: tuple[str, ...] = RANK_MODULES) -> None:
    """Start this process's forkserver now, importing ``modules`` meanwhile (a server already running
    stays as it is: its ranks import what it lacks)."""
    rank_context().set_forkserver_preload(list(modules))
    # The server (and the resource tracker started with it) inherits this thread's signal mask through
    # fork and exec: blocked rather than ignored, so that a signal meant for this process in the
    # meantime is only delayed.
    with signals_blocked(GROUP_SIGNALS):
        multiprocessing.forkserver.ensure_running()


@contextmanager
def signals_blocked(signals: tuple[signal.Signals, ...]) -> Iterator[None]:
    """Hold ``signals`` back from this thread inside the block; any that came are delivered after it."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def become_rank() -> None:
    """The first thing a process forked from the server does: take its process group's signals again
    (a signal that came since the fork is delivered now), and die with the server.

    A rank forks nothing from the server itself. The server's death signal is SIGKILL, for a rank deep in one long operation whose signal handler
    would not run until it returns; a launcher that is still alive stops its ranks more gently first.
    """
    signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_SIGNALS)
    # Python gives each process it forks the write end of the pipe the server watches, so that the
    # server outlives every one of them; a rank lets go of it, and the server ends with the launcher.
    server: Any = multiprocessing.forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    die_with_parent(signal.SIGKILL)


def run_quietly_as_rank(target: Callable[..., None], *args: object) -> None:
    """``target(*args)`` in a helper process forked from the server that the process which started it
    stops (a measurement of ``isthmus profile``): Ctrl-C at the terminal is that process's to answer,
    and reaches this one as its kill rather than as a traceback of its own. SIGINT is ignored first
    thing: a Ctrl-C during `become_rank` would otherwise print multiprocessing's "Process ...:" line."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    become_rank()
    target(*args)


def die_with_parent(signum: signal.Signals) -> None:
    """Have the kernel send ``signum`` to this process when its parent exits (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if parent == 1 or os.getppid() != parent:  # the parent exited before the kernel was told
        os.kill(os.getpid(), signum)


def rank_server_death() -> tuple[int, str] | None:
    """``(pid, how)`` once this process's rank server has died (``how``: ``SIGKILL``, ``exit code 1``), so
    that a launcher whose ranks all failed can say why; None while it lives or if none was started.

    multiprocessing keeps the server's pid to itself; it is read here, and the server's end read from
    /proc without reaping it (multiprocessing reaps it when it starts the next one)."""
    server: Any = multiprocessing.forkserver._forkserver
    pid = server._forkserver_pid
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return pid, "ended"
    if fields[0] != "Z":
        return None
    status = int(fields[49])  # field 52, exit_code: the status waitpid would return
    if status & 0x7F:
        return pid, signal.Signals(status & 0x7F).name
    return pid, f"exit code {status >> 8}"


def wait_for_rank_server() -> None:
    """Return once the server has imported its modules (it forks nothing before): for a caller about
    to time something that the server's import would slow down."""
    probe = rank_context().Process(target=os.getpid)
    probe.start()
    probe.join()


def run_module(module: str, argv: list[str]) -> None:
    """``python -m MODULE ARGV`` in this process, as a rank forked from the server runs what torchrun
    would have started as a command (its ``runpy`` entry for scripts does the same): the module's
    ``SystemExit`` is the process's exit code."""
    become_rank()
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def unbuffered_ranks() -> None:
    """torchrun starts ``python -u``: the server (and so every rank forked from it) writes unbuffered
    too, so a rank's lines reach its log as they are printed. Call before `start_rank_server`."""
    os.environ["PYTHONUNBUFFERED"] = "1"
