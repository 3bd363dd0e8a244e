"""The servers an emulation runs inside a namespace: ``python -m isthmus.launch.emulate.servers NAME ...``.

- ``store ADDRESS PORT``: the c10d rendezvous store of one job over every datacenter (why it is a
  process of its own: :mod:`isthmus.launch.emulate.services`), multi-tenant as torchrun's own (the
  agent's workers may share it).
- ``lighthouse ADDRESS PORT HEARTBEAT_TIMEOUT_MS JOIN_TIMEOUT_MS``: a fault-tolerant run's torchft
  Lighthouse.

Each prints one line once it serves (``ready``, or the Lighthouse's ``http://`` address) and then
serves until it is stopped; the emulator waits for that line before anything uses it.
"""

from __future__ import annotations

import sys
import time
from typing import NoReturn


def _serve_forever(server: object, ready_line: str) -> NoReturn:
    """Say ``ready_line`` on stdout, then keep ``server`` (it serves on threads of its own) until stopped."""
    sys.stdout.write(ready_line + "\n")
    sys.stdout.flush()
    while True:
        time.sleep(3600)


def run_store(address: str, port: int) -> NoReturn:
    from torch.distributed import TCPStore

    store = TCPStore(address, port, is_master=True, wait_for_workers=False, multi_tenant=True)
    _serve_forever(store, "ready")


def run_lighthouse(address: str, port: int, heartbeat_timeout_ms: int, join_timeout_ms: int) -> NoReturn:
    from isthmus.geo.fault import start_lighthouse

    lighthouse = start_lighthouse(
        address, port, heartbeat_timeout_ms=heartbeat_timeout_ms, join_timeout_ms=join_timeout_ms
    )
    _serve_forever(lighthouse, lighthouse.address)


def main(argv: list[str]) -> int:
    name, *args = argv
    if name == "store":
        address, port = args
        run_store(address, int(port))
    elif name == "lighthouse":
        address, port, heartbeat_timeout_ms, join_timeout_ms = args
        run_lighthouse(address, int(port), int(heartbeat_timeout_ms), int(join_timeout_ms))
    raise SystemExit(f"isthmus.launch.emulate.servers: no server named {name!r} (store, lighthouse)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
