"""Run a function on N real processes joined by a real gloo process group (for tests).

Each rank gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT like under torchrun (the
port that of a store this process serves, `isthmus.parallel.rendezvous`), a gloo default group, and one intra-op thread (the machine has 2 cores; more would oversubscribe).
The function's return value (anything picklable) comes back as a list indexed by rank; an
exception on any rank fails the call with that rank's traceback, at once.

Shared start. Ranks are forks of one forkserver per test session that imported torch and isthmus
once (as the launcher's ranks, `isthmus.launch.warm`); each rank takes the parent's environment as it
is when the rank starts, as a spawned one would. Starting ranks still costs more than most cases
run (each joins gloo; spawned, each also imported torch: ~3 s for 2 ranks, ~15 s for 8), so the
ranks of a world size are started once per test session and kept (a :class:`RankPool`), and each
call hands them a job. Between jobs a rank puts back what a job may leave behind: the environment,
the working directory and its thread count. The process groups a job made stay: DTensor and
DeviceMesh keep specs and meshes that compare by value (a later job's equal mesh can be answered
with an earlier one), so destroying them fails a later job with "could not resolve the process
group". Idle groups are not free (their gloo threads cost an idle rank up to a tenth of a core once
a few hundred have piled up), so pools live for one test module, not the session (conftest closes
them). A job that fails or runs out of time takes its pool down; the next
call starts a new one. ``fresh=True`` runs a job on ranks of its own, for a job that leaves the
default group unusable (a collective that timed out) or must start from a new process.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from isthmus.parallel.rendezvous import LOOPBACK, loopback_store_server, served_group_args

START_METHOD = "forkserver"
PRELOAD = ["isthmus.launch.local", "isthmus.api"]
"""What the session's forkserver imports once, for every rank forked from it (torch, DTensor, FSDP,
the trainer)."""


def _context() -> Any:
    ctx = mp.get_context(START_METHOD)
    ctx.set_forkserver_preload(PRELOAD)  # (no effect once the server runs)
    return ctx


def free_port() -> int:
    """A port free now, for a command that binds it itself (torchrun's rendezvous endpoint); ranks this
    module starts use a store served before they exist instead (`isthmus.parallel.rendezvous`)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _join_world(rank: int, world: int, port: int, environ: dict[str, str]) -> None:
    import torch
    import torch.distributed as dist

    # The parent's environment when it started this rank (a fork of the server has the server's).
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR=LOOPBACK,
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", **served_group_args(port, rank, world))


def _entry(
    rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, out_dir: str, environ: dict[str, str]
) -> None:
    """A rank of its own for one job (``fresh=True``)."""
    import torch.distributed as dist

    out = Path(out_dir) / f"rank{rank}.pkl"
    try:
        _join_world(rank, world, port, environ)
        result: Any = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        result = ("error", traceback.format_exc())
    out.write_bytes(pickle.dumps(result))
    if dist.is_initialized():
        # Everyone done before anyone tears down: gloo can abort if a peer leaves mid-teardown.
        if result[0] == "ok":
            dist.barrier()
        dist.destroy_process_group()


def _tidy_after_job(environ: dict[str, str], cwd: str) -> None:
    """Put back what a job may change in its process, so the next job starts as a new process would."""
    import torch

    if os.getcwd() != cwd:
        os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)


def _serve(
    rank: int, world: int, port: int, conn: multiprocessing.connection.Connection, environ: dict[str, str]
) -> None:
    """A pooled rank: join the world once, then run the jobs the parent sends until it sends None."""
    import torch.distributed as dist

    _join_world(rank, world, port, environ)
    environ, cwd = dict(os.environ), os.getcwd()
    while (job := pickle.loads(conn.recv_bytes())) is not None:
        fn, args = job
        try:
            result: Any = ("ok", fn(*args))
            payload = pickle.dumps(result)
        except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
            result = ("error", traceback.format_exc())
            payload = pickle.dumps(result)
        if result[0] == "ok":
            _tidy_after_job(environ, cwd)
            dist.barrier()  # every rank's job done before the next begins
        conn.send_bytes(payload)
    dist.destroy_process_group()


class RankPool:
    """``world`` ranks started once, running one job at a time (see the module's doc)."""

    def __init__(self, world: int) -> None:
        ctx = _context()
        self.world = world
        self.conns: list[multiprocessing.connection.Connection] = []
        self.procs: list[Any] = []
        # The ranks' store, served here (bound before they start) for the pool's life.
        self.store = ExitStack()
        port = self.store.enter_context(loopback_store_server())
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world, port, child, dict(os.environ)), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> list[Any]:
        """Results by rank; any rank's error, a rank that dies, or the timeout ends the pool and fails the call."""
        job = pickle.dumps((fn, args))
        for conn in self.conns:
            conn.send_bytes(job)
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world:
            pending = [r for r in range(self.world) if r not in results]
            watched = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending]
            if not multiprocessing.connection.wait(watched, timeout=max(deadline - time.monotonic(), 0)):
                self.kill()
                raise AssertionError(f"{self.world} ranks did not finish within {timeout:.0f} s")
            for rank in pending:
                conn = self.conns[rank]
                if conn.poll():
                    status, value = pickle.loads(conn.recv_bytes())
                    if status == "error":
                        self.kill()
                        raise AssertionError(f"rank {rank} failed:\n{value}")
                    results[rank] = value
                elif not self.procs[rank].is_alive():
                    code = self.procs[rank].exitcode
                    self.kill()
                    raise AssertionError(f"rank {rank} exited (code {code}) without a result")
        return [results[r] for r in range(self.world)]

    def close(self) -> None:
        """Ask idle ranks to leave the world cleanly; kill what does not."""
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send_bytes(pickle.dumps(None))
                except OSError:
                    pass
        deadline = time.monotonic() + 10
        for proc in self.procs:
            proc.join(timeout=max(deadline - time.monotonic(), 0))
        self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join()
        for conn in self.conns:
            conn.close()
        self.store.close()


class _Pools:
    """The live pools by world size, for one test module (conftest closes them at its end)."""

    def __init__(self) -> None:
        self.by_world: dict[int, RankPool] = {}

    def get(self, world: int) -> RankPool:
        pool = self.by_world.get(world)
        if pool is None or not pool.alive():
            pool = self.by_world[world] = RankPool(world)
        return pool

    def close(self) -> None:
        for pool in self.by_world.values():
            pool.close()
        self.by_world.clear()


POOLS = _Pools()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300, fresh: bool = False) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` gloo ranks; returns each rank's result."""
    if not fresh:
        pool = POOLS.get(world)
        try:
            return pool.run(fn, args, timeout)
        finally:
            if not pool.alive():
                POOLS.by_world.pop(world, None)
    with tempfile.TemporaryDirectory() as out_dir, loopback_store_server() as port:
        _context()
        ctx = mp.start_processes(
            _entry,
            args=(world, port, fn, args, out_dir, dict(os.environ)),
            nprocs=world,
            join=False,
            start_method=START_METHOD,
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
