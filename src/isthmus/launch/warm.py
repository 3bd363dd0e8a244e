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

START_METHOD = "forkserver"
RANK_MODULE = "isthmus.launch.local"
"""What a rank runs (`run_rank`) and everything it imports: torch, torch.distributed, the trainer."""


def start_rank_server() -> None:
    """Start the forkserver of this launcher's ranks now (idempotent); it imports ``RANK_MODULE`` meanwhile."""
    multiprocessing.get_context(START_METHOD).set_forkserver_preload([RANK_MODULE])
    multiprocessing.forkserver.ensure_running()
