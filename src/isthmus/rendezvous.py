"""Where a rank finds its process group's store.

Under torchrun (and the emulator's per-datacenter torchrun) the env:// way stands: rank 0 serves a
TCPStore on MASTER_PORT and the others connect to it. The local launcher (`isthmus.launch.local`)
serves the ranks' store itself instead, on loopback, and names it in ``ISTHMUS_STORE``.

Why not env:// there too: torch's agent picks MASTER_PORT by binding port 0 and letting go of it
(``get_free_port``); rank 0 binds it again a second or more later, once it has started, and any
socket that took the number in between (an outgoing connection's local port is enough) fails the
run with EADDRINUSE. The launcher's store is bound before any rank exists. Each restart of the
ranks keys its group under a prefix of its own: the store outlives the ranks, and a restarted rank
must not read the gloo addresses the dead ones left (what torch's own store sharing runs into,
pytorch/pytorch#135712).
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

STORE_ENV = "ISTHMUS_STORE"
"""``host:port`` of the store the local launcher serves for its ranks; unset under other launchers."""


def store_address() -> tuple[str, int]:
    """The address of this rank's group store: the launcher's (``ISTHMUS_STORE``), else MASTER_ADDR:MASTER_PORT."""
    served = os.environ.get(STORE_ENV)
    if served:
        host, port = served.rsplit(":", 1)
        return host, int(port)
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def group_store_args(world: int) -> dict[str, Any]:
    """Keyword arguments for ``init_process_group``: the launcher's store under this attempt's prefix,
    or none (env://) when no launcher serves one."""
    if not os.environ.get(STORE_ENV):
        return {}
    host, port = store_address()
    store = dist.TCPStore(host, port, is_master=False, timeout=default_pg_timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {
        "store": dist.PrefixStore(f"isthmus/attempt{attempt}/", store),
        "rank": int(os.environ["RANK"]),
        "world_size": world,
    }
