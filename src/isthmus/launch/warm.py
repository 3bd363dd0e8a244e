"""Local ranks forked from an interpreter that has imported torch and isthmus once, not spawned to import them each.

Why: a spawned rank imports torch, DTensor, the pipelining schedules and the trainer itself, about
3.5 s of one core, and every rank of a launch (and of each restart) pays it, after the launcher paid
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
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import runpy
import sys
from typing import Final

from isthmus.config import JobConfig
from isthmus.launch.environ import launcher_world

START_METHOD: Final = "forkserver"
RANK_MODULES = ("isthmus.launch.local", "isthmus.cli.main")
"""What a rank runs (`run_rank`, or the `isthmus` command) and everything it imports: torch,
torch.distributed, the trainer."""


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
    multiprocessing.forkserver.ensure_running()


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
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def unbuffered_ranks() -> None:
    """torchrun starts ``python -u``: the server (and so every rank forked from it) writes unbuffered
    too, so a rank's lines reach its log as they are printed. Call before `start_rank_server`."""
    os.environ["PYTHONUNBUFFERED"] = "1"
