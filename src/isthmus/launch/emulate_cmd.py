"""`isthmus emulate --topology FILE -- train ...`: a training run across emulated datacenters.

The topology file is the planner's: its datacenters become network namespaces of ``devices``
ranks each, its WAN links become ``tc``-shaped links. What the run needs to know of them (the
number of datacenters, the replicas in each) is added to the train command unless given.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from isthmus.errors import ConfigError, IsthmusError
from isthmus.log import get_logger


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "emulate",
        allow_abbrev=False,
        help="run `train` across datacenters emulated with network namespaces and shaped links (root)",
        description="Build one network namespace per datacenter of the topology, shape the WAN links with tc, "
        "run the train command after `--` with each datacenter's ranks inside its namespace, and remove it all "
        "on exit. Latency is not emulated (tc netem is unavailable on this kernel).",
    )
    p.add_argument("--topology", default="emulated-2dc", help="topology preset name or TOML file (default: emulated-2dc)")
    p.add_argument("--wan-mbit", type=float, default=None, help="override every WAN link's rate, in Mbit/s")
    p.add_argument("--timeout", type=float, default=None, help="stop the run after this many seconds")
    p.add_argument("--log-dir", default=None, help="where each datacenter's launcher log goes (default: <run_dir>/logs)")
    p.add_argument("--dc-restarts", type=int, default=0, metavar="N",
                   help="with --geo.fault_tolerant true: restart a datacenter's ranks up to N times when they die; "
                   "they rejoin from the global model (default: 0)")


def _train_args(argv: list[str], n_dc: int, ranks_per_dc: int) -> list[str]:
    if not argv or argv[0] != "train":
        raise IsthmusError("isthmus emulate: give the training command after --, e.g. `isthmus emulate -- train --config tiny`")
    args = list(argv)
    given = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    if "--geo.datacenters" not in given:
        args += ["--geo.datacenters", str(n_dc)]
    degrees = {"--parallel.dp_replicate", "--parallel.dp_shard", "--parallel.tp", "--parallel.pp", "--parallel.cp"}
    if not degrees & given:
        args += ["--parallel.dp_replicate", str(ranks_per_dc)]
    return args


def run(ns: argparse.Namespace, rest: list[str]) -> int:
    from isthmus.launch.emulate import LATENCY_NOTE, EmulatedDatacenter, EmulatedNetwork, launch_emulated
    from isthmus.topology import load_topology

    topo = load_topology(ns.topology)
    if len(topo.datacenters) < 2:
        raise ConfigError("--topology", ns.topology, "needs at least 2 datacenters to emulate")
    sizes = {dc.devices for dc in topo.datacenters}
    if len(sizes) != 1:
        raise ConfigError("--topology", ns.topology, f"datacenters must hold equal numbers of ranks to train across them (got {sorted(sizes)})")
    if ns.wan_mbit is not None and ns.wan_mbit <= 0:
        raise ConfigError("--wan-mbit", ns.wan_mbit, "must be positive")
    names = [dc.name for dc in topo.datacenters]
    per_pair: dict[tuple[int, int], float] = {}
    for i, a in enumerate(names):
        for j, b in enumerate(names[i + 1:], i + 1):
            link = topo.wan.get(frozenset((a, b)))
            if link is None:
                raise ConfigError("--topology", ns.topology, f"no WAN link between {a!r} and {b!r}")
            per_pair[(i, j)] = ns.wan_mbit if ns.wan_mbit is not None else link.bandwidth * 8 / 1e6
    rates = set(per_pair.values())
    net = EmulatedNetwork(
        datacenters=[EmulatedDatacenter(dc.name, dc.devices) for dc in topo.datacenters],
        wan_mbit=min(rates),
        wan_mbit_per_pair=per_pair if len(rates) > 1 else None,
    )
    if ns.dc_restarts < 0:
        raise ConfigError("--dc-restarts", ns.dc_restarts, "must be 0 or more")
    train_argv = _train_args(rest, len(names), sizes.pop())
    fault_tolerant = _fault_tolerant(train_argv)
    if ns.dc_restarts and not fault_tolerant:
        raise ConfigError("--dc-restarts", ns.dc_restarts, "needs --geo.fault_tolerant true in the train command")
    log = get_logger()
    log.warning("%s", LATENCY_NOTE)
    log.info("emulating %d datacenters (%s), WAN %s Mbit/s", len(names), ", ".join(names),
             "/".join(f"{r:g}" for r in sorted(rates)))
    log_dir = Path(ns.log_dir) if ns.log_dir else None
    return launch_emulated(net, train_argv, log_dir=log_dir, timeout_s=ns.timeout, fault_tolerant=fault_tolerant,
                           max_restarts=ns.dc_restarts)


def _fault_tolerant(train_argv: list[str]) -> bool:
    """Whether the train command (its --config and overrides, validated here first) asks for geo.fault_tolerant."""
    from isthmus.cli import find_config
    from isthmus.config import build_config, parse_overrides

    config, rest, i = None, [], 1
    while i < len(train_argv):
        a = train_argv[i]
        if a == "--config" and i + 1 < len(train_argv):
            config, i = train_argv[i + 1], i + 2
            continue
        if a.startswith("--config="):
            config = a.split("=", 1)[1]
        elif a != "--print-config":
            rest.append(a)
        i += 1
    cfg = build_config(find_config(config), parse_overrides(rest))
    if cfg.geo.fault_tolerant:
        from isthmus.geo.fault import check_config

        check_config(cfg.geo)
    return cfg.geo.fault_tolerant
