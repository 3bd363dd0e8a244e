"""Where a rank finds its process group's store, and the loopback store a launcher serves for its ranks.

Under torchrun (and the emulator's per-datacenter torchrun) the env:// way stands: rank 0 serves a
TCPStore on MASTER_PORT and the others connect to it. A process that starts ranks on this machine
(the local launcher, `isthmus.launch.local`; the tests' and benchmarks' rank harnesses) serves the
ranks' store itself instead, on loopback, and names it in ``ISTHMUS_STORE``.

Why not env:// there too: the port must be chosen before the ranks exist, and choosing one means
binding port 0 and letting go of it (torch's agent: ``get_free_port``); rank 0 binds it again a
second or more later, once it has started, and any socket that took the number in between (an
outgoing connection's local port is enough) fails the run with EADDRINUSE. A served store is bound
before any rank exists. Each restart of the ranks keys its group under a prefix of its own: the
store outlives the ranks, and a restarted rank must not read the gloo addresses the dead ones left
(what torch's own store sharing runs into, pytorch/pytorch#135712).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

STORE_ENV = "ISTHMUS_STORE"
"""``host:port`` of the store the process that started the ranks serves for them; unset under torchrun."""

LOOPBACK = "127.0.0.1"


@contextmanager
def loopback_store_server() -> Iterator[int]:
    """Serve a TCPStore on a free port of 127.0.0.1 in this process while the block runs; yields the port.

    Why by hand: torch's TCPStore server listens on every interface, IPv4 and IPv6, whatever host it
    is given; only a socket bound beforehand and handed over as ``master_listen_fd`` keeps it on
    loopback. torch's agent creates its c10d rendezvous store itself, with ``multi_tenant=True``: a
    multi-tenant TCPStore on a port this process already serves shares that server instead of
    starting one of its own, so torch's code runs unchanged.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen()
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    # The server owns the socket from here on and closes it when the last store using it goes.
    server = dist.TCPStore(
        LOOPBACK, port, is_master=True, multi_tenant=True, wait_for_workers=False, master_listen_fd=sock.detach()
    )
    try:
        yield port
    finally:
        del server


def served_store_environ(port: int) -> dict[str, str]:
    """What a rank started by this process needs to find the store it serves on ``port``."""
    return {STORE_ENV: f"{LOOPBACK}:{port}"}


def store_address() -> tuple[str, int]:
    """The address of this rank's group store: the served one (``ISTHMUS_STORE``), else MASTER_ADDR:MASTER_PORT."""
    served = os.environ.get(STORE_ENV)
    if served:
        host, port = served.rsplit(":", 1)
        return host, int(port)
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def group_store_args(world: int, rank: int | None = None) -> dict[str, Any]:
    """Keyword arguments for ``init_process_group``: the served store under this attempt's prefix, or
    none (env://) when nobody serves one. ``rank``: the environment's RANK when not given."""
    if not os.environ.get(STORE_ENV):
        return {}
    host, port = store_address()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return served_group_args(port, int(os.environ["RANK"]) if rank is None else rank, world, host, attempt)


def served_group_args(port: int, rank: int, world: int, host: str = LOOPBACK, attempt: int = 0) -> dict[str, Any]:
    """Keyword arguments for ``init_process_group`` joining the store served on ``host:port``, keyed
    under ``attempt`` (a restart's own keys)."""
    store = dist.TCPStore(host, port, is_master=False, timeout=default_pg_timeout)
    return {"store": dist.PrefixStore(f"isthmus/attempt{attempt}/", store), "rank": rank, "world_size": world}
