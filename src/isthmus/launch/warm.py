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
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os

START_METHOD = "forkserver"
RANK_MODULES = ["isthmus.launch.local", "isthmus.cli.main"]
"""What a rank runs (`run_rank`, or the `isthmus` command) and everything it imports: torch,
torch.distributed, the trainer."""


def start_rank_server() -> None:
    """Start the forkserver of this launcher's ranks now (idempotent); it imports ``RANK_MODULES`` meanwhile."""
    multiprocessing.get_context(START_METHOD).set_forkserver_preload(RANK_MODULES)
    multiprocessing.forkserver.ensure_running()


def isthmus_command(argv: list[str]) -> None:
    """``python -u -m isthmus ARGV`` (what torchrun would start) as a rank forked from the server
    runs it: the command's exit code becomes the process's."""
    from isthmus.cli.main import main

    code = main(argv)
    if code:
        raise SystemExit(code)


def unbuffered_ranks() -> None:
    """torchrun starts ``python -u``: the server (and so every rank forked from it) writes unbuffered
    too, so a rank's lines reach its log as they are printed. Call before `start_rank_server`."""
    os.environ["PYTHONUNBUFFERED"] = "1"
