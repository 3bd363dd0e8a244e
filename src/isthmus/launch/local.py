"""Start a run's ranks on this machine with torch's elastic launcher, or join an external torchrun.

`isthmus train --parallel.nproc N` lands here: N worker processes, a c10d rendezvous on a free
loopback port, gloo on CPU and NCCL on CUDA. Rank 0 drives the console; every rank writes its own
log file in ``<run_dir>/logs``. Under an external ``torchrun`` (RANK/WORLD_SIZE already set) the
same entry point trains as that one rank, single- or multi-node.

Restarts (``parallel.max_restarts``): when a rank dies, torch's agent stops the others (a rank
blocked in a collective with the dead one included), starts all ranks again and sets
``TORCHELASTIC_RESTART_COUNT``. A restarted rank resumes from the newest checkpoint this launch
committed (``checkpoint.resume = auto``), or, before the first save, starts as the first attempt
did; only the steps since that checkpoint are redone. A rank that stopped on a user error (its
``rank<N>.error``) is not retried: the restarted ranks exit at once with the same error. Caveat: with
``checkpoint.async_save`` a surviving rank can block in its save thread on the dead peer and never
exit by itself; the agent kills it (SIGTERM, then SIGKILL) before restarting, so a launch with
restarts is not delayed, but under another launcher that does not tear the group down it would
wait for the gloo timeout.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from isthmus.config import JobConfig
from isthmus.errors import IsthmusError
from isthmus.log import get_logger, setup_logging
from isthmus.launch.rundir import CLAIMED_ENV, RunDirClaim, claim_run_dir
from isthmus.train.checkpoint_manifest import MANIFEST_FILE, committed_checkpoints
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


def run_rank(cfg: JobConfig, launched_at: float | None = None) -> TrainResult:
    """The body of one rank: logging (console on rank 0 only), threads, then training.

    ``launched_at`` (a ``time.time()``) is when the launch began: a restarted rank resumes only from
    checkpoints committed since then, never from those an earlier run left in the directory.
    """
    rank = int(os.environ.get("RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log_dir = Path(cfg.train.run_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(logging.INFO, log_file=str(log_dir / f"rank{rank}.log"), console=rank == 0)
    if restart > 0:
        if any(log_dir.glob("rank*.error")):
            raise SystemExit(2)  # a user error comes back on every attempt; the launcher reports it once
        note = prepare_restart(cfg, restart, launched_at)
        if rank == 0:
            get_logger().warning("%s", note)
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


def prepare_restart(cfg: JobConfig, restart: int, launched_at: float | None) -> str:
    """Point ``cfg.checkpoint.resume`` at the newest checkpoint of this launch; returns the console line.

    Before this launch's first save there is nothing newer to resume from: the restart starts as the
    first attempt did (fresh, or from the checkpoint it was given).
    """
    c = cfg.checkpoint
    root = Path(c.dir) if c.dir else Path(cfg.train.run_dir) / "checkpoints"
    committed = committed_checkpoints(root)
    ours = [(step, path) for step, path in committed if launched_at is None or _committed_at(path) >= launched_at]
    reached = last_logged_step(_metrics_path(cfg))
    of = f"restart {restart}/{os.environ.get('TORCHELASTIC_MAX_RESTARTS', cfg.parallel.max_restarts)}"
    if not ours:
        start = "starting over" if c.resume == "none" else f"starting as the first attempt did (checkpoint.resume = {c.resume})"
        return f"{of}: a rank failed after step {reached}, before this run's first checkpoint; {start} (steps 1..{reached} are redone)"
    step, path = ours[0]
    # auto also falls back to an older good one if this one is damaged; an older run's checkpoints
    # with higher steps in the same directory are not this run's, so then name ours explicitly.
    c.resume = "auto" if committed[0][1] == path else str(path)
    redone = f"steps {step + 1}..{reached} are redone" if reached > step + 1 else (
        f"step {reached} is redone" if reached == step + 1 else "no step is redone"
    )
    return f"{of}: a rank failed after step {reached}; resuming from {path.name} ({redone})"


def _committed_at(checkpoint: Path) -> float:
    try:
        return (checkpoint / MANIFEST_FILE).stat().st_mtime
    except OSError:
        return 0.0


def _metrics_path(cfg: JobConfig) -> Path:
    return Path(cfg.metrics.jsonl) if cfg.metrics.jsonl else Path(cfg.train.run_dir) / "metrics.jsonl"


def last_logged_step(path: Path) -> int:
    """The last step ``metrics.jsonl`` records (0 if none); a line torn by a killed writer is skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def check_external_launch(cfg: JobConfig, world: int) -> None:
    """What a run started by an external launcher of ``world`` ranks (torchrun) may not ask for."""
    if cfg.parallel.nproc not in (1, world):
        raise IsthmusError(f"parallel.nproc = {cfg.parallel.nproc}: the launcher started {world} ranks; set it to {world} or leave it at 1")
    if cfg.parallel.max_restarts:
        raise IsthmusError(
            f"parallel.max_restarts = {cfg.parallel.max_restarts}: under an external launcher restarts are its own "
            "(torchrun --max-restarts N); leave it at 0"
        )


def launch(cfg: JobConfig, config_name: str = "default") -> TrainResult:
    """Train ``cfg``: in this process (nproc 1 or under torchrun) or on nproc local ranks.

    The launching process claims the run directory first (`claim_run_dir`: placeholders resolved,
    locked while it lives, an earlier run's files never adopted unasked); ``config_name`` fills
    ``{config}`` in ``train.run_dir``.
    """
    if launched_externally():
        world = int(os.environ["WORLD_SIZE"])
        check_external_launch(cfg, world)
        cfg.parallel.nproc = world
        claim = _claim_under_launcher(cfg, config_name)
        try:
            return run_rank(cfg)
        finally:
            if claim is not None:
                claim.release()
    claim = claim_run_dir(cfg, config_name)
    try:
        if cfg.parallel.nproc == 1 and cfg.parallel.max_restarts == 0:
            return train(cfg)
        return _launch_local(cfg)
    finally:
        claim.release()


def _claim_under_launcher(cfg: JobConfig, config_name: str) -> RunDirClaim | None:
    """Under torchrun: global rank 0 claims the run directory and tells the others which it is.

    Ranks on other nodes could resolve ``{time}`` differently, so the process group is joined first
    (the trainer reuses it) and rank 0's answer, or its one-line refusal, is broadcast. A launcher
    that claimed the directory itself (``isthmus emulate``) says so in the environment.
    """
    if os.environ.get(CLAIMED_ENV) == cfg.train.run_dir:
        return None
    import torch.distributed as dist

    from isthmus.train.device import resolve_device
    from isthmus.train.trainer import init_distributed

    device = resolve_device(cfg.train.device, int(os.environ.get("LOCAL_RANK", "0")))
    world = init_distributed(cfg.parallel.backend, device)
    claim, answer = None, [cfg.train.run_dir, None]
    if int(os.environ["RANK"]) == 0:
        try:
            claim = claim_run_dir(cfg, config_name)
            answer[0] = cfg.train.run_dir
        except IsthmusError as e:
            answer[1] = str(e)
    if world > 1:
        dist.broadcast_object_list(answer, src=0)
    if answer[1] is not None:
        raise IsthmusError(answer[1])
    cfg.train.run_dir = answer[0]
    return claim


def _launch_local(cfg: JobConfig) -> TrainResult:
    """``parallel.nproc`` ranks on this machine under torch's elastic agent (restarts included)."""
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
        max_restarts=cfg.parallel.max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs" / "elastic")),
    )
    # The agent logs every failed worker with its own traceback; the one line below says it better
    # and names the per-rank logs, which keep everything.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # ...and torch's process context warns as it terminates the survivors of a dead rank.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    # A little in the past: the clock of a checkpoint's mtime may be coarser than time.time().
    launched_at = time.time() - 1.0
    # The agent shares its rendezvous store with the workers and keeps it across restarts, so the
    # restarted ranks read the dead ranks' gloo addresses still in it (pytorch/pytorch#135712);
    # a store of their own per attempt avoids that.
    no_shared_store = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if cfg.parallel.max_restarts else {}
    try:
        with _environ(no_shared_store):
            results = elastic_launch(config, run_rank)(cfg, launched_at)
    except ChildFailedError as e:
        errors = sorted((run_dir / "logs").glob("rank*.error"))
        if errors:
            raise IsthmusError(f"{errors[0].read_text().strip()} ({errors[0].stem})") from None
        first = min(e.failures)
        failure = e.failures[first]
        detail = _first_line(failure.message) or f"exit code {failure.exitcode}"
        restarts = cfg.parallel.max_restarts
        left = f"after {restarts} restart(s), none left" if restarts else "no restart"
        raise IsthmusError(
            f"rank {failure.local_rank} failed ({detail}); {left} (parallel.max_restarts = {restarts}); see {run_dir / 'logs'}"
        ) from None
    return results[0]


def _first_line(message: object) -> str:
    """The first line of a worker failure: a string (a signal) or the error file's {"message": ...}."""
    if isinstance(message, dict):
        message = message.get("message", "")
    lines = str(message or "").strip().splitlines()
    return lines[0] if lines else ""


@contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables (inherited by the workers) for the duration of the launch."""
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
