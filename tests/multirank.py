"""Run a function on N real processes joined by a real gloo process group (for tests).

Each rank gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT like under torchrun,
a gloo default group, and one intra-op thread (the machine has 2 cores; more would oversubscribe).
The function's return value (anything picklable) comes back as a list indexed by rank; an
exception on any rank fails the call with that rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    out = Path(out_dir) / f"rank{rank}.pkl"
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result: Any = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        result = ("error", traceback.format_exc())
    out.write_bytes(pickle.dumps(result))
    if dist.is_initialized():
        # Everyone done before anyone tears down: gloo can abort if a peer leaves mid-teardown.
        if result[0] == "ok":
            dist.barrier()
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` gloo ranks; returns each rank's result."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry, args=(world, free_port(), fn, args, out_dir), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                raise AssertionError(f"{world} ranks did not finish within {timeout:.0f} s")
        results = []
        for rank in range(world):
            status, value = pickle.loads((Path(out_dir) / f"rank{rank}.pkl").read_bytes())
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
