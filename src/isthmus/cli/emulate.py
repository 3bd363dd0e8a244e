"""`isthmus emulate --topology FILE -- train ...`: a training run across emulated datacenters
(`isthmus emulate --hosts N -- train ...`, a run across emulated hosts: `isthmus.cli.emulate_hosts`).

The topology file is the planner's: its datacenters become network namespaces of ``devices``
ranks each, its WAN links become ``tc``-shaped links delayed by their ``latency_us`` each way
(a user-space delay line, :mod:`isthmus.launch.delayline`). What the run needs to know of them (the
number of datacenters, the world size) is added to the train command unless given, and the whole
command is validated here, as its ranks will run it, before anything is made.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from isthmus.checkpoint.manifest import resume_note
from isthmus.cli.emulate_hosts import run_hosts
from isthmus.cli.train import config_name, find_config, parse_train_command, train_config
from isthmus.config import JobConfig, build_config, parse_overrides
from isthmus.errors import ConfigError, Interrupted, IsthmusError, RunFailed
from isthmus.launch.emulate import (
    MAX_RTT_MS,
    MAX_WINDOW_KIB,
    MIN_WINDOW_KIB,
    EmulatedDatacenter,
    EmulatedNetwork,
    HelperDied,
    launch_emulated,
)
from isthmus.launch.environ import environ
from isthmus.launch.rundir import CLAIMED_ENV, claim_run_dir
from isthmus.log import get_logger
from isthmus.planner.topology import Topology, load_topology


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "emulate",
        allow_abbrev=False,
        help="run `train` across datacenters emulated with network namespaces and shaped, delayed links (root)",
        description="Build one network namespace per datacenter of the topology, shape the WAN links with tc, "
        "run the train command after `--` with each datacenter's ranks inside its namespace, and remove it all "
        "on exit. A link's latency (the topology's latency_us one way, or --wan-rtt-ms) is emulated by a user-space "
        "delay line (tc netem is unavailable on this kernel). With --hosts N: N emulated hosts instead, each "
        "running one torchrun of an N-node job, as a cluster's nodes do.",
    )
    p.add_argument("--topology", default=None, help="topology preset name or TOML file (default: emulated-2dc)")
    p.add_argument(
        "--hosts",
        type=int,
        default=None,
        metavar="N",
        help="instead of datacenters: N emulated hosts named host0..hostN-1, each running "
        "`torchrun --nnodes N --rdzv-endpoint host0:29400 -m isthmus train ...` as a real node would",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="K",
        help="with --hosts: ranks per host, torchrun's --nproc-per-node (default: 1)",
    )
    p.add_argument("--wan-mbit", type=float, default=None, help="override every WAN link's rate, in Mbit/s")
    p.add_argument(
        "--wan-rtt-ms",
        type=float,
        default=None,
        metavar="MS",
        help="override every WAN link's round-trip time, in ms (half each way; 0: no delay)",
    )
    p.add_argument(
        "--wan-window-kib",
        type=int,
        default=None,
        metavar="KIB",
        help="limit every TCP window in the datacenters to KIB KiB, so that one flow carries at most "
        "window / RTT (as across regions); 0: the kernel's autotuning; default: the topology's WAN "
        "window_kib (the smallest), else 0",
    )
    p.add_argument("--timeout", type=float, default=None, help="stop the run after this many seconds")
    p.add_argument(
        "--log-dir", default=None, help="write each datacenter's output to DIR/dc<i>.log (default: this console)"
    )
    p.add_argument(
        "--dc-restarts",
        type=int,
        default=0,
        metavar="N",
        help="with --geo.fault_tolerant true: restart a datacenter's ranks up to N times when they die; "
        "they rejoin from the global model (default: 0)",
    )


@dataclass(frozen=True)
class TrainCommand:
    """The train command every datacenter's ranks run, validated as they will run it."""

    argv: list[str]
    """``train ...`` with what the topology decides added."""
    config: JobConfig
    """The config one rank builds from ``argv`` (degrees filled in, as under torchrun)."""
    print_config: bool
    """``--print-config`` was given: show ``config`` instead of running."""
    config_name: str
    """What ``{config}`` in train.run_dir becomes."""


def train_command(argv: list[str], topology: str, n_dc: int, ranks_per_dc: int) -> TrainCommand:
    """Check the train command after ``--`` as every rank would, before any namespace or rank exists.

    The world comes from the topology: ``--geo.datacenters`` and ``--parallel.nproc`` are added
    unless given (and must then agree with it); the data-parallel degree fills what the named
    degrees leave. Under ``geo.fault_tolerant`` each datacenter is a job of its own, so a rank's
    launcher starts only its datacenter's ranks. Raises the error a rank would, once.
    """
    # launch.local loads torch (seconds): only for a train command that got this far.
    from isthmus.launch.local import check_external_launch

    if not argv or argv[0] != "train":
        raise IsthmusError(
            "isthmus emulate: give the training command after --, e.g. `isthmus emulate -- train --config tiny`"
        )
    ns, rest = parse_train_command(argv)
    given = dict(parse_overrides(rest))
    asked = build_config(find_config(ns.config), list(given.items()))
    world = n_dc * ranks_per_dc
    job_world = ranks_per_dc if asked.geo.fault_tolerant else world
    if "geo.datacenters" in given and asked.geo.datacenters != n_dc:
        raise ConfigError(
            "geo.datacenters",
            asked.geo.datacenters,
            f"the topology {topology} has {n_dc} datacenters (leave it out: isthmus emulate sets it)",
        )
    if "parallel.nproc" in given and asked.parallel.nproc not in (1, job_world):
        each = (
            f"; each datacenter is a job of {ranks_per_dc} under geo.fault_tolerant" if asked.geo.fault_tolerant else ""
        )
        raise ConfigError(
            "parallel.nproc",
            asked.parallel.nproc,
            f"the topology {topology} runs {world} ranks ({n_dc} datacenters x {ranks_per_dc}){each}; "
            f"set it to {job_world} or leave it out",
        )
    if asked.parallel.max_restarts:
        raise ConfigError(
            "parallel.max_restarts",
            asked.parallel.max_restarts,
            "is not used by isthmus emulate: restart a datacenter's ranks with --dc-restarts N "
            "(with --geo.fault_tolerant true)",
        )
    args = list(argv)
    if "geo.datacenters" not in given:
        args += ["--geo.datacenters", str(n_dc)]
    if "parallel.nproc" not in given:
        args += ["--parallel.nproc", str(job_world)]
    ns, rest = parse_train_command(args)
    with _as_torchrun_rank(job_world, ranks_per_dc):
        cfg = train_config(ns.config, rest, announce=False)
    check_external_launch(cfg, job_world)
    return TrainCommand(args, cfg, ns.print_config, config_name(ns.config))


def _as_torchrun_rank(world: int, local_world: int) -> AbstractContextManager[None]:
    """This process's environment as torchrun gives its rank 0, for the duration (then restored)."""
    return environ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local_world)})


def emulated_network_of(
    topo: Topology, topology: str, wan_mbit: float | None = None, wan_rtt_ms: float | None = None
) -> EmulatedNetwork:
    """The network to emulate for ``topo`` (named ``topology`` in errors): its datacenters, each WAN
    link's rate and RTT, or ``wan_mbit`` / ``wan_rtt_ms`` for every link when given."""
    if wan_mbit is not None and wan_mbit <= 0:
        raise ConfigError("--wan-mbit", wan_mbit, "must be positive")
    if wan_rtt_ms is not None and not 0 <= wan_rtt_ms <= MAX_RTT_MS:
        raise ConfigError("--wan-rtt-ms", wan_rtt_ms, f"must be between 0 and {MAX_RTT_MS:g} ms")
    names = [dc.name for dc in topo.datacenters]
    per_pair: dict[tuple[int, int], float] = {}
    rtt_per_pair: dict[tuple[int, int], float] = {}
    for i, a in enumerate(names):
        for j, b in enumerate(names[i + 1 :], i + 1):
            link = topo.wan.get(frozenset((a, b)))
            if link is None:
                raise ConfigError("--topology", topology, f"no WAN link between {a!r} and {b!r}")
            per_pair[(i, j)] = wan_mbit if wan_mbit is not None else link.bandwidth * 8 / 1e6
            # The topology's latency is one way (time = latency + bytes / bandwidth): the RTT is twice it.
            rtt_per_pair[(i, j)] = wan_rtt_ms if wan_rtt_ms is not None else 2 * link.latency * 1e3
    rates = set(per_pair.values())
    rtts = set(rtt_per_pair.values())
    return EmulatedNetwork(
        datacenters=[EmulatedDatacenter(dc.name, dc.devices) for dc in topo.datacenters],
        wan_mbit=min(rates),
        wan_mbit_per_pair=per_pair if len(rates) > 1 else None,
        wan_rtt_ms=min(rtts),
        wan_rtt_ms_per_pair=rtt_per_pair if len(rtts) > 1 else None,
    )


def topology_window_kib(topo: Topology) -> int:
    """The TCP window the topology's WAN links give their flows (the smallest; the emulator limits
    every namespace alike), KiB; 0 where none is set (the kernel's autotuning)."""
    windows = [link.window for link in topo.wan.values() if math.isfinite(link.window)]
    return round(min(windows) / 1024) if windows else 0


def run(ns: argparse.Namespace, rest: list[str]) -> int:
    if ns.hosts is not None:
        return run_hosts(ns, rest)
    if ns.nproc_per_node != 1:
        raise ConfigError(
            "--nproc-per-node", ns.nproc_per_node, "is for --hosts; a topology sets each datacenter's ranks"
        )
    ns.topology = ns.topology or "emulated-2dc"
    topo = load_topology(ns.topology)
    if len(topo.datacenters) < 2:
        raise ConfigError("--topology", ns.topology, "needs at least 2 datacenters to emulate")
    sizes = {dc.devices for dc in topo.datacenters}
    if len(sizes) != 1:
        raise ConfigError(
            "--topology",
            ns.topology,
            f"datacenters must hold equal numbers of ranks to train across them (got {sorted(sizes)})",
        )
    window = ns.wan_window_kib if ns.wan_window_kib is not None else topology_window_kib(topo)
    if window and not MIN_WINDOW_KIB <= window <= MAX_WINDOW_KIB:
        raise ConfigError(
            "--wan-window-kib" if ns.wan_window_kib is not None else "topology.wan.window_kib",
            window,
            f"must be 0 (autotuned) or between {MIN_WINDOW_KIB} and {MAX_WINDOW_KIB} KiB",
        )
    net = replace(emulated_network_of(topo, ns.topology, ns.wan_mbit, ns.wan_rtt_ms), wan_window_kib=window)
    if ns.dc_restarts < 0:
        raise ConfigError("--dc-restarts", ns.dc_restarts, "must be 0 or more")
    command = train_command(rest, ns.topology, len(topo.datacenters), sizes.pop())
    fault_tolerant = command.config.geo.fault_tolerant
    if ns.dc_restarts and not fault_tolerant:
        raise ConfigError("--dc-restarts", ns.dc_restarts, "needs --geo.fault_tolerant true in the train command")
    if command.print_config:
        sys.stdout.write(command.config.to_toml())
        return 0
    added = command.argv[len(rest) :]
    if added:
        get_logger().info("the topology's part of the train command: %s", " ".join(added))
    log_dir = Path(ns.log_dir) if ns.log_dir else None
    with _claimed_run_dir(command) as (argv, env):
        try:
            rc = launch_emulated(
                net,
                argv,
                env=env,
                log_dir=log_dir,
                timeout_s=ns.timeout,
                fault_tolerant=fault_tolerant,
                max_restarts=ns.dc_restarts,
            )
        except HelperDied as e:
            # Nothing in the ranks' output says it: the line names what died and where to go on from.
            cfg = command.config
            root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.train.run_dir) / "checkpoints"
            raise RunFailed(f"the emulated run failed: {e}; {resume_note(root, cfg.checkpoint.every)}") from None
    return _exit_code(rc, ns.timeout, log_dir, Path(command.config.train.run_dir) / "logs", net.world_size)


@contextmanager
def _claimed_run_dir(command: TrainCommand) -> Iterator[tuple[list[str], dict[str, str]]]:
    """Claim the run directory here, for the whole run, before anything is made; yields the train
    command and the environment that tell every rank which directory it is and that it is claimed.

    The ranks must not claim it themselves: under geo.fault_tolerant each datacenter is a job with a
    rank 0 of its own, and the second to claim the directory would find it taken by the first.
    """
    claim = claim_run_dir(command.config, command.config_name)
    run_dir = command.config.train.run_dir  # concrete now: {config} and {time} resolved once, here
    for pattern in ("rank*.error", "rank*.done"):  # an earlier attempt's, resumed here
        for stale in (Path(run_dir) / "logs").glob(pattern):
            stale.unlink()
    try:
        yield [*command.argv, "--train.run_dir", run_dir], {CLAIMED_ENV: run_dir}
    finally:
        claim.release()


def _exit_code(rc: int, timeout_s: float | None, log_dir: Path | None, rank_logs: Path, world: int) -> int:
    """The launcher's code as the CLI reports it: 0, or one line and the signal's 128+N when it was
    stopped, or exit 3 for a run that failed (the agents' own code, torchrun's 1, says nothing more).

    A rank that stopped on an error of isthmus's own left its line in ``rank_logs`` (``rank<N>.error``):
    the last line repeats the first such line, with its exit code. When every rank marked its run
    finished (``rank<N>.done``, written after the final model), a datacenter's launcher that failed
    afterwards, while shutting down (and the others stopped because of it), spoiled nothing: the
    run succeeded, and a warning says what happened.
    """
    if rc == 0:
        return 0
    from isthmus.launch.local import count_ranks_done, read_rank_errors  # torch: loaded by the run's checks

    if count_ranks_done(rank_logs) >= world:
        get_logger().warning(
            "every rank finished its run; a datacenter's launcher then exited with code %d while shutting down", rc
        )
        return 0
    if rc > 128:
        name = signal.Signals(rc - 128).name if rc - 128 in signal.valid_signals() else f"signal {rc - 128}"
        raise Interrupted(rc - 128, f"interrupted ({name}): every rank was stopped and the network removed")
    where = f"see {log_dir}/dc<i>.log" if log_dir is not None else "its ranks' output is above"
    if rc == 124 and timeout_s is not None:
        raise RunFailed(f"the emulated run passed its --timeout of {timeout_s:g} s and was stopped; {where}")

    errors = read_rank_errors(rank_logs)
    if errors:
        rank, message, code = errors[0]
        error = RunFailed(f"the emulated run failed: {message} (rank {rank}); {where}")
        error.exit_code = code
        raise error
    raise RunFailed(f"the emulated run failed: a datacenter's rank exited with code {rc}; {where}")
