"""Start a run's ranks on this machine with torch's elastic launcher, or join an external torchrun.

`isthmus train --parallel.nproc N` lands here: N worker processes, a c10d rendezvous on a free
loopback port, gloo on CPU and NCCL on CUDA. Rank 0 drives the console; every rank writes its own
log file in ``<run_dir>/logs``. Under an external ``torchrun`` (RANK/WORLD_SIZE already set) the
same entry point trains as that one rank, single- or multi-node.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from pathlib import Path

from isthmus.config import JobConfig
from isthmus.errors import IsthmusError
from isthmus.log import setup_logging
from isthmus.train.trainer import TrainResult, train


def launched_externally() -> bool:
    """True inside a process started by torchrun (or another launcher that sets the env:// variables)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads_per_rank(cfg: JobConfig, local_world: int) -> int:
    if cfg.train.threads:
        return cfg.train.threads
    # Ranks share the machine's cores; more threads than cores per rank only thrash.
    return max(1, (os.cpu_count() or 1) // max(1, local_world))


def run_rank(cfg: JobConfig) -> TrainResult:
    """The body of one rank: logging (console on rank 0 only), threads, then training."""
    rank = int(os.environ.get("RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    log_dir = Path(cfg.train.run_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(logging.INFO, log_file=str(log_dir / f"rank{rank}.log"), console=rank == 0)
    import torch

    torch.set_num_threads(_threads_per_rank(cfg, local_world))
    if rank != 0:
        cfg.metrics.progress = False
    try:
        return train(cfg)
    except IsthmusError as e:
        # The launcher reports a rank's user error as the one line it is, not as a traceback.
        (log_dir / f"rank{rank}.error").write_text(str(e))
        raise SystemExit(2) from None


def launch(cfg: JobConfig) -> TrainResult:
    """Train ``cfg``: in this process (nproc 1 or under torchrun) or on nproc local ranks."""
    if launched_externally():
        world = int(os.environ["WORLD_SIZE"])
        if cfg.parallel.nproc not in (1, world):
            raise IsthmusError(f"parallel.nproc = {cfg.parallel.nproc}: the launcher started {world} ranks; set it to {world} or leave it at 1")
        cfg.parallel.nproc = world
        return run_rank(cfg)
    if cfg.parallel.nproc == 1:
        return train(cfg)
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    run_dir = Path(cfg.train.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    for stale in (run_dir / "logs").glob("rank*.error"):
        stale.unlink()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.parallel.nproc,
        run_id=uuid.uuid4().hex[:12],
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs" / "elastic")),
    )
    # The agent logs every failed worker with its own traceback; the one line below says it better
    # and names the per-rank logs, which keep everything.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        results = elastic_launch(config, run_rank)(cfg)
    except ChildFailedError as e:
        errors = sorted((run_dir / "logs").glob("rank*.error"))
        if errors:
            raise IsthmusError(f"{errors[0].read_text().strip()} ({errors[0].stem})") from None
        first = min(e.failures)
        failure = e.failures[first]
        raise IsthmusError(
            f"rank {failure.local_rank} failed ({failure.message.splitlines()[0] if failure.message else 'exit code ' + str(failure.exitcode)}); "
            f"see {run_dir / 'logs'}"
        ) from None
    return results[0]
