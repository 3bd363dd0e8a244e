"""Environment variables set for the duration of a block, then restored (what a launcher hands its children)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

from isthmus.errors import IsthmusError


@contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` (inherited by processes started meanwhile); restore the old ones after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def launcher_world() -> int | None:
    """The world size an external launcher (torchrun, or the emulator's agents) gave this process, or None."""
    return int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None


QUIET_EXIT_DELAY_S = 3.0
"""How long a rank that leaves the line to its host's local rank 0 waits before it exits."""


AGENT_DIR_ENV = "ISTHMUS_AGENT_DIR"
"""The folder of a host's agent (`isthmus.launch.agent`) where its ranks say where the job's end is
posted (`isthmus.launch.jobwatch.HostGuard`)."""


def spans_hosts() -> bool:
    """Whether this process is a rank of an external launch (torchrun) whose ranks run on more than one host."""
    try:
        return "RANK" in os.environ and int(os.environ["WORLD_SIZE"]) > int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return False


def where(rank: int, host: str | None = None) -> str:
    """``rank 3 on host1``: how a line names a rank of a job on several hosts."""
    return f"rank {rank} on {host or socket.gethostname()}"


def said_once_per_host(e: IsthmusError, named: bool = True) -> BaseException:
    """An error every rank of a job on several hosts raises alike: each host's local rank 0 says it,
    naming itself unless the line ``named`` the rank it came from already; the others exit quietly
    with its code. Anywhere else, the error as it is."""
    if not spans_hosts():
        return e
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        # The rank that says it may be a moment behind, and the agent stops the others as soon as one
        # rank exits: a quiet rank leaves only after it.
        time.sleep(QUIET_EXIT_DELAY_S)
        return SystemExit(e.exit_code)
    if named:
        return e
    said = IsthmusError(f"{e} ({where(int(os.environ['RANK']))})")
    said.exit_code = e.exit_code
    return said
