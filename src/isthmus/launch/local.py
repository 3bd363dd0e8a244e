"""Start a run's ranks on this machine with torch's elastic launcher, or join an external torchrun.

`isthmus train --parallel.nproc N` lands here: N worker processes, a c10d rendezvous on a free
loopback port, gloo on CPU and NCCL on CUDA. Everything such a run listens on is on 127.0.0.1: the
ranks talk only to each other, and torch's stores would otherwise listen on every interface, without
authentication, holding rendezvous state that torch unpickles. Rank 0 drives the console; every
rank writes its own log file in ``<run_dir>/logs``. Under an external ``torchrun`` (RANK/WORLD_SIZE
already set) the same entry point trains as that one rank, single- or multi-node.

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

Failures end in one line and the exit code of `isthmus.errors`: a rank's own error (bad input, a
full disk, a non-finite loss) travels as ``rank<N>.error`` (JSON: the line and its exit code); a rank
that stops answering is named by the heartbeats (`isthmus.launch.heartbeat`); SIGINT / SIGTERM stop
every rank (`isthmus.launch.stop`). These files, and torch's own error files, live in a temporary
launch directory (``ISTHMUS_LAUNCH_DIR``) rather than the run directory, whose disk may be full.
Each rank's stderr goes to its log file, so nothing but rank 0's log lines and the launcher's last
line reach the console.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from isthmus.checkpoint.manifest import MANIFEST_FILE, committed_checkpoints
from isthmus.config import JobConfig
from isthmus.errors import EXIT_RUN_FAILED, EXIT_USAGE, Interrupted, IsthmusError, RunFailed, full_disk_as
from isthmus.launch.environ import environ, launcher_world, said_once_per_host, spans_hosts, where
from isthmus.launch.heartbeat import Heartbeat, StallMonitor, beat_interval, read_beats
from isthmus.launch.jobwatch import JOB_TOKEN_ENV, JobEnd, JobWatch
from isthmus.launch.rundir import CLAIMED_ENV, RunDirClaim, claim_run_dir, lock_host_dir, mark_job, shares_job_dir
from isthmus.launch.stop import STOP_SIGNALS, Stopped, StopState, interrupted_line, stop_on_signals
from isthmus.launch.warm import (
    START_METHOD,
    become_rank,
    rank_server_death,
    start_rank_server,
    starts_local_ranks,
)
from isthmus.log import get_logger, redirect_stderr, route_library_warnings, setup_logging, silence_console
from isthmus.parallel.rendezvous import LOOPBACK, loopback_store_server, served_store_environ, store_address
from isthmus.profile.device import resolve_device
from isthmus.train.membership import last_logged_step
from isthmus.train.trainer import Progress, TrainResult, init_distributed, train

LAUNCH_DIR_ENV = "ISTHMUS_LAUNCH_DIR"
"""The launcher's temporary directory (rank errors, heartbeats), set for the ranks it starts."""


def launched_externally() -> bool:
    """True inside a process started by torchrun (or another launcher that sets the env:// variables)."""
    return launcher_world() is not None


SHUTDOWN_GRACE_S = 3
"""How long the ranks of a stopped run have to unwind by themselves before they are killed."""

LOOPBACK_IFNAME = "lo0" if sys.platform == "darwin" else "lo"
"""The loopback interface, where gloo binds for a run on one machine (GLOO_SOCKET_IFNAME)."""


def _threads_per_rank(cfg: JobConfig, local_world: int) -> int:
    if cfg.train.threads:
        return cfg.train.threads
    # Ranks share the machine's cores; more threads than cores per rank only thrash.
    return max(1, (os.cpu_count() or 1) // max(1, local_world))


def run_rank(cfg: JobConfig, launched_at: float | None = None, environ: dict[str, str] | None = None) -> TrainResult:
    """The body of one rank: logging (console on rank 0 only), threads, heartbeat, then training.

    ``launched_at`` (a ``time.time()``) is when the launch began: a restarted rank resumes only from
    checkpoints committed since then, never from those an earlier run left in the directory.
    ``environ``: what the local launcher set for its ranks (a rank forked from
    `isthmus.launch.warm`'s server has the environment the server started with), its store's
    address among it (`isthmus.parallel.rendezvous`).
    """
    if environ is not None:  # forked from the launcher's server (`isthmus.launch.warm`), not run in place
        become_rank()
    os.environ.update(environ or {})
    rank = int(os.environ.get("RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    launch_dir = Path(os.environ[LAUNCH_DIR_ENV]) if LAUNCH_DIR_ENV in os.environ else None
    log_file = _rank_log_file(cfg, rank)
    console: TextIO | None = redirect_stderr(log_file) if launch_dir is not None else sys.stderr
    setup_logging(logging.INFO, log_file=str(log_file), console=rank == 0, console_stream=console)
    route_library_warnings()
    # Under an external launcher (its own restarts, no launch directory) the errors stay with the logs.
    error_dir = launch_dir if launch_dir is not None else log_file.parent
    if restart > 0:
        if read_rank_errors(error_dir):
            raise SystemExit(EXIT_USAGE)  # a user error comes back on every attempt; the launcher reports it once
        note = prepare_restart(cfg, restart, launched_at)
        if rank == 0:
            get_logger().warning("%s", note)

    torch.set_num_threads(_threads_per_rank(cfg, local_world))
    if rank != 0:
        cfg.metrics.progress = False
    progress = Progress()
    heartbeat = None
    if launch_dir is not None:
        heartbeat = Heartbeat(launch_dir / f"rank{rank}.beat", rank, progress, beat_interval(cfg.parallel.timeout_s))
        heartbeat.start()
    watch = None
    # torchrun on several hosts: the ranks watch each other (emulated datacenters have their emulator's watch)
    if launch_dir is None and spans_hosts() and os.environ.get(CLAIMED_ENV) != cfg.train.run_dir:
        first_here = int(os.environ.get("LOCAL_RANK", "0")) == 0
        world = int(os.environ["WORLD_SIZE"])
        watch = JobWatch(
            rank,
            world,
            lambda: progress.step,
            cfg.parallel.timeout_s,
            watcher=first_here,
            console=console if first_here else None,
        )
        watch.start()
    # From the signal on, this rank's lines go to its log file only: the launcher prints the one line.
    with stop_on_signals(on_stop=silence_console) as stop:
        if watch is not None:
            watch.take_signals(lambda: stop.signum is not None)
        try:
            result = train(cfg, progress)
            write_rank_done(error_dir, rank, progress.step)
            return result
        except BaseException as e:
            if watch is not None:
                raise _host_rank_exit(e, stop, cfg, rank, progress, watch, error_dir) from None
            raise _rank_exit(e, stop, cfg, rank, progress, launch_dir, error_dir) from None
        finally:
            if heartbeat is not None:
                heartbeat.stop()
            if watch is not None:
                watch.stop()


def _rank_log_file(cfg: JobConfig, rank: int) -> Path:
    log_dir = Path(cfg.train.run_dir) / "logs"
    with full_disk_as("logs folder", log_dir, "train.run_dir"):
        log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir / f"rank{rank}.log"


def _rank_exit(
    e: BaseException,
    stop: StopState,
    cfg: JobConfig,
    rank: int,
    progress: Progress,
    launch_dir: Path | None,
    error_dir: Path,
) -> BaseException:
    """What a rank that failed raises: a quiet exit with the right code, the error itself otherwise.

    A signal wins over the error it caused (a collective that failed because a peer stopped first).
    A user's error goes to ``rank<N>.error``: under our launcher for its one line (and the rank exits
    quietly), under an external one for its restarts (and the rank prints the line itself).
    """
    if stop.signum is not None:
        silence_console()
        get_logger().info("stopped by signal %d after step %d", stop.signum, progress.step)
        if launch_dir is None and rank == 0:  # an external launcher: rank 0 says it
            return Interrupted(
                stop.signum, interrupted_line(stop.signum, progress.step, _checkpoint_root(cfg), cfg.checkpoint.every)
            )
        return SystemExit(128 + stop.signum)
    if isinstance(e, IsthmusError):
        try:
            write_rank_error(error_dir, rank, e)
        except OSError:
            pass  # (a full disk under an external launcher) the line below still says it
        if launch_dir is not None:
            silence_console()
            get_logger().error("%s", e)
            return SystemExit(e.exit_code)
    elif launch_dir is not None:
        # torch's elastic wrapper keeps an unexpected error's traceback only in its error file, inside
        # the launch directory, which is removed: the launcher's line points at this log, so it goes here.
        silence_console()
        get_logger().error("rank %d failed", rank, exc_info=e)
    return e


def _host_rank_exit(
    e: BaseException, stop: StopState, cfg: JobConfig, rank: int, progress: Progress, watch: JobWatch, error_dir: Path
) -> BaseException:
    """What a rank of a job on several hosts raises: the job's end, the first reason any rank posted
    (`isthmus.launch.jobwatch`), with its exit code on every rank; each host's local rank 0 says it.

    A signal, or this rank's own error, is posted as the reason; a collective that failed (the
    peers left) waits a moment for the reason of the rank that knows it, and is the reason itself
    (a lost connection, exit 3) when none comes.
    """
    silence_console()
    here = where(rank, watch.host)
    if stop.signum is not None:
        cause = f"{signal.Signals(stop.signum).name} to {here}"
        end = watch.post(JobEnd("signal", rank, watch.host, 128 + stop.signum, cause))
        if watch.store_lost and end.rank == rank:
            # torch's agent stops its ranks when it loses the c10d store, which lives in the rendezvous
            # host's agent: the signal is the agent's, the reason that host
            host, _ = store_address()
            end = replace(end, line=f"{cause}: its agent lost the job's store on {host} (the rendezvous host is gone)")
    elif isinstance(e, IsthmusError):
        try:
            write_rank_error(error_dir, rank, e)
        except OSError:
            pass
        end = watch.post(JobEnd("error", rank, watch.host, e.exit_code, f"{e} ({here})"))
    else:
        get_logger().error("%s failed", here, exc_info=e)
        posted = watch.wait_for_end(2.0)
        if posted is not None:
            end = posted
        else:
            # No rank can post any more when the job's store is gone with the rendezvous host's agent.
            head = f" and the job's store on {store_address()[0]} (the rendezvous host)" if watch.store_lost else ""
            end = watch.post(
                JobEnd(
                    "lost",
                    rank,
                    watch.host,
                    EXIT_RUN_FAILED,
                    f"{here} lost the job's other ranks{head} ({_transport_words(e)}); "
                    f"see {Path(cfg.train.run_dir) / 'logs'} on each host",
                )
            )
    get_logger().info("the job ends: %s", end.line)
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return SystemExit(end.code)
    if end.kind == "signal":
        signum = end.code - 128
        line = interrupted_line(signum, progress.step, _checkpoint_root(cfg), cfg.checkpoint.every, cause=end.line)
        return Interrupted(signum, line)
    error = IsthmusError(end.line)
    error.exit_code = end.code
    return error


def _transport_words(e: BaseException) -> str:
    """What gloo says went away, without its source path and advice: ``Connection closed by peer
    [10.213.0.101]:56488``."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", _first_line(str(e)))
    return text.split(". ")[0].rstrip(".") or type(e).__name__


def write_rank_error(directory: Path, rank: int, e: IsthmusError) -> None:
    tmp = directory / f"rank{rank}.error.tmp"
    tmp.write_text(json.dumps({"message": str(e), "exit_code": e.exit_code}))
    tmp.replace(directory / f"rank{rank}.error")


def write_rank_done(directory: Path, rank: int, step: int) -> None:
    """Mark this rank's run finished (``rank<N>.done``): a launcher that then fails while shutting
    down (a C++ thread torn down at exit) is not mistaken for a failed run."""
    try:
        (directory / f"rank{rank}.done").write_text(json.dumps({"step": step}))
    except OSError:  # a full disk: the run is done all the same, only this mark is lost
        pass


def count_ranks_done(directory: Path) -> int:
    """How many ranks marked their run finished (:func:`write_rank_done`)."""
    return sum(1 for _ in directory.glob("rank*.done"))


def read_rank_errors(directory: Path) -> list[tuple[int, str, int]]:
    """(rank, line, exit code) of every rank that stopped on an isthmus error, by rank."""
    found = []
    for path in directory.glob("rank*.error"):
        try:
            body = json.loads(path.read_text())
            found.append((int(path.stem[4:]), str(body["message"]), int(body["exit_code"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(found)


def prepare_restart(cfg: JobConfig, restart: int, launched_at: float | None) -> str:
    """Point ``cfg.checkpoint.resume`` at the newest checkpoint of this launch; returns the console line.

    Before this launch's first save there is nothing newer to resume from: the restart starts as the
    first attempt did (fresh, or from the checkpoint it was given).
    """
    c = cfg.checkpoint
    committed = committed_checkpoints(_checkpoint_root(cfg))
    ours = [(step, path) for step, path in committed if launched_at is None or _committed_at(path) >= launched_at]
    reached = last_logged_step(_metrics_path(cfg))
    of = f"restart {restart}/{os.environ.get('TORCHELASTIC_MAX_RESTARTS', cfg.parallel.max_restarts)}"
    if not ours:
        start = (
            "starting over"
            if c.resume == "none"
            else f"starting as the first attempt did (checkpoint.resume = {c.resume})"
        )
        return f"{of}: a rank failed after step {reached}, before this run's first checkpoint; {start} (steps 1..{reached} are redone)"
    step, path = ours[0]
    # auto also falls back to an older good one if this one is damaged; an older run's checkpoints
    # with higher steps in the same directory are not this run's, so then name ours explicitly.
    c.resume = "auto" if committed[0][1] == path else str(path)
    redone = (
        f"steps {step + 1}..{reached} are redone"
        if reached > step + 1
        else (f"step {reached} is redone" if reached == step + 1 else "no step is redone")
    )
    return f"{of}: a rank failed after step {reached}; resuming from {path.name} ({redone})"


def _committed_at(checkpoint: Path) -> float:
    try:
        return (checkpoint / MANIFEST_FILE).stat().st_mtime
    except OSError:
        return 0.0


def _checkpoint_root(cfg: JobConfig) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.train.run_dir) / "checkpoints"


def _metrics_path(cfg: JobConfig) -> Path:
    return Path(cfg.metrics.jsonl) if cfg.metrics.jsonl else Path(cfg.train.run_dir) / "metrics.jsonl"


def check_external_launch(cfg: JobConfig, world: int) -> None:
    """What a run started by an external launcher of ``world`` ranks (torchrun) may not ask for."""
    if cfg.parallel.nproc not in (1, world):
        raise IsthmusError(
            f"parallel.nproc = {cfg.parallel.nproc}: the launcher started {world} ranks; set it to {world} or leave it at 1"
        )
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

    The local ranks listen on loopback only: this process serves the c10d rendezvous store on
    127.0.0.1 and the ranks' groups use it too (`isthmus.parallel.rendezvous`; MASTER_ADDR is 127.0.0.1, not
    the hostname), and gloo binds the loopback interface. Under torchrun or the emulator the launcher's own
    addresses stand.
    """
    if launched_externally():
        world = int(os.environ["WORLD_SIZE"])
        try:
            check_external_launch(cfg, world)
        except IsthmusError as e:
            raise said_once_per_host(e, named=False) from None
        cfg.parallel.nproc = world
        try:
            claim = _claim_under_launcher(cfg, config_name)
            try:
                return run_rank(cfg)
            finally:
                if claim is not None:
                    claim.release()
        finally:
            if dist.is_initialized():  # this process's own group (joined to claim, reused by the trainer)
                dist.destroy_process_group()
    claim = claim_run_dir(cfg, config_name)
    try:
        if not starts_local_ranks(cfg):
            return _train_here(cfg)
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

    device = resolve_device(cfg.train.device, int(os.environ.get("LOCAL_RANK", "0")))
    world, _ = init_distributed(cfg.parallel.backend, device)
    several_hosts = spans_hosts()
    claim, answer = None, [cfg.train.run_dir, None, uuid.uuid4().hex]  # [directory, refusal, job token]
    if int(os.environ["RANK"]) == 0:
        try:
            claim = claim_run_dir(cfg, config_name)
            answer[0] = cfg.train.run_dir
            if several_hosts:
                mark_job(Path(cfg.train.run_dir), str(answer[2]))
                if cfg.checkpoint.dir:
                    _checkpoint_root(cfg).mkdir(parents=True, exist_ok=True)
                    mark_job(_checkpoint_root(cfg), str(answer[2]))
        except IsthmusError as e:
            answer[1] = str(e) + (f" ({where(0)})" if several_hosts else "")
    if world > 1:
        dist.broadcast_object_list(answer, src=0)
    if answer[1] is not None:
        raise said_once_per_host(IsthmusError(answer[1]))
    cfg.train.run_dir = str(answer[0])
    if several_hosts:
        os.environ[JOB_TOKEN_ENV] = str(answer[2])  # this attempt's keys on the job's store (`JobWatch`)
        claim = _claim_on_each_host(cfg, world, str(answer[2])) or claim
    return claim


def _claim_on_each_host(cfg: JobConfig, world: int, token: str) -> RunDirClaim | None:
    """A job on several hosts: is the run directory one folder that every host sees, or one per host?

    Rank 0 left the job's token in the directories it claimed (`isthmus.launch.rundir.mark_job`; the
    broadcast before this was the barrier), and each host's local rank 0 looks for it. A host that
    finds it shares rank 0's directory, and rank 0's lock covers the job there. A host that does not
    has a folder of its own by that name: its local rank 0 locks it too (a second job on that host
    is refused there), and it holds that host's logs and checkpoints (`isthmus.checkpoint.hostlocal`);
    a ``checkpoint.dir`` of the host's own is locked likewise.
    The answers are gathered, so every rank ends the same way.
    """
    rank, first_here = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")) == 0
    run_dir, root = Path(cfg.train.run_dir), _checkpoint_root(cfg)
    claim, seen = None, None  # (host, refusal)
    if first_here:
        refusal = None
        try:
            if rank != 0 and not shares_job_dir(run_dir, token):
                claim = lock_host_dir(run_dir)
            if rank != 0 and cfg.checkpoint.dir and not shares_job_dir(root, token):
                held = lock_host_dir(root, "checkpoint.dir")  # a checkpoint folder of this host's own
                claim = held if claim is None else claim.absorb(held)
        except IsthmusError as e:
            if claim is not None:
                claim.release()
                claim = None
            refusal = f"{e} ({where(rank)})"
        seen = (socket.gethostname(), refusal)
    answers: list[Any] = [None] * world
    dist.all_gather_object(answers, seen)
    refusals = [a[1] for a in answers if a is not None and a[1] is not None]
    if refusals:
        if claim is not None:
            claim.release()
        error = IsthmusError(refusals[0])
        raise said_once_per_host(error)
    return claim


def _launch_local(cfg: JobConfig) -> TrainResult:
    """``parallel.nproc`` ranks on this machine under torch's elastic agent (restarts included)."""
    launch_dir = Path(tempfile.mkdtemp(prefix="isthmus-launch-"))
    try:
        with stop_on_signals():
            return _launch_ranks(cfg, launch_dir)
    except Stopped as e:  # before torch's agent took the signals over, or after
        raise Interrupted(e.signum, _interrupted(cfg, e.signum, launch_dir)) from None
    finally:
        shutil.rmtree(launch_dir, ignore_errors=True)


def _train_here(cfg: JobConfig) -> TrainResult:
    """One process: the CLI's own; a signal stops it with the one line."""
    progress = Progress()
    with stop_on_signals(on_stop=silence_console) as stop:
        try:
            return train(cfg, progress)
        except BaseException:
            if stop.signum is None:
                raise
            # (also when the signal came inside a library that wrapped it in an error of its own)
            line = interrupted_line(stop.signum, progress.step, _checkpoint_root(cfg), cfg.checkpoint.every)
            raise Interrupted(stop.signum, line) from None


def _interrupted(cfg: JobConfig, signum: int, launch_dir: Path) -> str:
    """The launcher's line for a signal: the step every rank had finished, from their heartbeats, or
    the last step the metrics record when that is later (a heartbeat is written every so often, so
    the slowest one can lag a step that every rank took and rank 0 already logged)."""
    steps = [b.step for b in read_beats(launch_dir)]
    step = max(min(steps) if steps else 0, last_logged_step(_metrics_path(cfg)))
    return interrupted_line(signum, step, _checkpoint_root(cfg), cfg.checkpoint.every)


def _launch_ranks(cfg: JobConfig, launch_dir: Path) -> TrainResult:
    """nproc local ranks under torch's elastic agent, watched for stalls; every failure as one line."""

    run_dir = Path(cfg.train.run_dir)
    with full_disk_as("logs folder", run_dir / "logs", "train.run_dir"):
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    # The agent logs every failed worker with its own traceback, and each signal; the one line below
    # says it better and names the per-rank logs, which keep everything. (Its modules set their own
    # levels, so each logger under it is quieted, not only the parent.)
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # ...and torch's process context warns as it terminates the survivors of a dead rank.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    # A little in the past: the clock of a checkpoint's mtime may be coarser than time.time().
    launched_at = time.time() - 1.0
    start_rank_server()  # (started already by `isthmus train`, to import beside this process)
    monitor = StallMonitor(launch_dir, cfg.parallel.timeout_s)
    monitor.start()
    try:
        # One store on loopback serves the agents' rendezvous and the ranks' groups (`isthmus.parallel.rendezvous`).
        with loopback_store_server() as rdzv_port:
            env = {LAUNCH_DIR_ENV: str(launch_dir), **served_store_environ(rdzv_port), **_loopback_environ()}
            config = LaunchConfig(
                min_nodes=1,
                max_nodes=1,
                nproc_per_node=cfg.parallel.nproc,
                run_id=uuid.uuid4().hex[:12],
                rdzv_backend="c10d",
                rdzv_endpoint=f"{LOOPBACK}:{rdzv_port}",
                # This process hosts the rendezvous store (already serving it on loopback, above).
                rdzv_configs={"is_host": True},
                # The workers' MASTER_ADDR; otherwise the hostname, which may not resolve here at all.
                local_addr=LOOPBACK,
                max_restarts=cfg.parallel.max_restarts,
                monitor_interval=0.2,
                # A rank deep in one long operation runs its signal handler only when the operation
                # returns: after this long the agent kills it rather than wait its default 30 s.
                shutdown_timeout=SHUTDOWN_GRACE_S,
                start_method=START_METHOD,
                logs_specs=DefaultLogsSpecs(log_dir=str(launch_dir / "elastic")),
            )
            with environ(env):
                return elastic_launch(config, run_rank)(cfg, launched_at, env)[0]
    except SignalException as e:
        raise Interrupted(int(e.sigval), _interrupted(cfg, int(e.sigval), launch_dir)) from None
    except ChildFailedError as e:
        raise _launch_failure(cfg, e, monitor, launch_dir) from None
    except json.JSONDecodeError:  # torch reads a rank's error file that a full disk cut short
        raise RunFailed(
            f"a rank failed and its error report in {launch_dir} is unreadable (a full disk?); see {run_dir / 'logs'}"
        ) from None
    finally:
        monitor.stop()


def _loopback_environ() -> dict[str, str]:
    """What the agent and the workers of a run on one machine need to listen on loopback only."""
    return {
        # The agent would host the workers' store itself, on every interface (torch offers no
        # setting for that server's address); the ranks use the launcher's loopback store instead
        # (STORE_ENV), keyed per restart.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        # gloo binds the address the hostname resolves to (and waits for a name that resolves
        # nowhere); on one machine the ranks need only loopback.
        "GLOO_SOCKET_IFNAME": LOOPBACK_IFNAME,
    }


def _launch_failure(cfg: JobConfig, e: ChildFailedError, monitor: StallMonitor, launch_dir: Path) -> IsthmusError:
    """The one line for ranks that failed: a stalled rank, a rank's own error, a signal, or a crash."""
    logs = Path(cfg.train.run_dir) / "logs"
    if monitor.stall is not None:
        s = monitor.stall
        return RunFailed(
            f"rank {s.rank} stopped answering for {s.silent_s:.0f} s (last step it finished: {s.step}); "
            f"stopped every rank (parallel.timeout_s = {cfg.parallel.timeout_s}); see {logs}"
        )
    errors = read_rank_errors(launch_dir)
    if errors:
        rank, message, code = errors[0]
        error = IsthmusError(f"{message} (rank{rank})")
        error.exit_code = code
        return error
    failures = e.failures
    first = min(failures)
    failure = failures[first]
    if failure.exitcode in [128 + s for s in STOP_SIGNALS]:  # the ranks got the signal before the launcher did
        signum = failure.exitcode - 128
        return Interrupted(signum, _interrupted(cfg, signum, launch_dir))
    restarts = cfg.parallel.max_restarts
    left = f"after {restarts} restart(s), none left" if restarts else "no restart"
    server = rank_server_death()
    if server is not None:  # the ranks died with it (`isthmus.launch.warm.become_rank`)
        return RunFailed(
            f"the rank server (pid {server[0]}), which every rank is forked from, died ({server[1]}) and its "
            f"ranks with it; {left} (parallel.max_restarts = {restarts}); see {logs}"
        )
    detail = _first_line(failure.message) or f"exit code {failure.exitcode}"
    return RunFailed(
        f"rank {failure.local_rank} failed ({detail}); {left} (parallel.max_restarts = {restarts}); see {logs}"
    )


def _first_line(message: object) -> str:
    """The first line of a worker failure: a string (a signal) or the error file's {"message": ...}."""
    if isinstance(message, dict):
        message = message.get("message", "")
    lines = str(message or "").strip().splitlines()
    return lines[0] if lines else ""
