"""`isthmus emulate --hosts N -- train ...`: a multi-node run rehearsed on one machine.

Each of N emulated hosts (`isthmus.launch.hosts`: a network namespace with its own address, a
hostname ``host<i>`` that every host resolves) runs what a real node runs::

    torchrun --nnodes N --nproc-per-node K --rdzv-backend c10d --rdzv-endpoint host0:29400 \\
        --rdzv-id ID -m isthmus train ...

Nothing else is set for the ranks: they find each other by name, as on a cluster. Each host's output
is relayed with its name in front (``host1| ...``); the first host that fails stops the others and
the run ends with one line and that host's exit code.
"""

from __future__ import annotations

import argparse
import signal
import sys

from isthmus.cli.train import parse_train_command, train_config
from isthmus.errors import ConfigError, Interrupted, IsthmusError, RunFailed
from isthmus.launch.environ import environ
from isthmus.launch.hosts import MAX_HOSTS, RDZV_PORT, EmulatedHosts, JobEnd, require_root, run_torchrun_job
from isthmus.log import get_logger

NOT_WITH_HOSTS = ("topology", "wan_mbit", "wan_rtt_ms", "wan_window_kib", "log_dir", "dc_restarts")
"""The datacenter emulator's flags: emulated hosts have no WAN and no datacenters."""


def check_hosts_flags(ns: argparse.Namespace) -> None:
    """``--hosts N --nproc-per-node K`` in range, and none of the datacenter emulator's flags beside them."""
    if not 1 <= ns.hosts <= MAX_HOSTS:
        raise ConfigError("--hosts", ns.hosts, f"must be between 1 and {MAX_HOSTS}")
    if ns.nproc_per_node < 1:
        raise ConfigError("--nproc-per-node", ns.nproc_per_node, "must be >= 1")
    for key in NOT_WITH_HOSTS:
        if getattr(ns, key) not in (None, 0):
            flag = "--" + key.replace("_", "-")
            raise ConfigError(flag, getattr(ns, key), "is for emulated datacenters; leave it out with --hosts")


def validate_train_command(argv: list[str], hosts: int, nproc_per_node: int) -> tuple[list[str], bool, str]:
    """Check the train command after ``--`` as rank 0 of the job will, before any host exists; returns
    (the command, whether it asks for --print-config, the resolved config as TOML)."""
    # launch.local loads torch (seconds): only for a train command that got this far.
    from isthmus.launch.local import check_external_launch

    if not argv or argv[0] != "train":
        raise IsthmusError(
            "isthmus emulate --hosts: give the training command after --, "
            "e.g. `isthmus emulate --hosts 2 -- train --config tiny`"
        )
    world = hosts * nproc_per_node
    ns, rest = parse_train_command(argv)
    rank0 = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(nproc_per_node)}
    with environ(rank0):  # as torchrun sets it for rank 0
        cfg = train_config(ns.config, rest, announce=False)
    check_external_launch(cfg, world)
    return argv, bool(ns.print_config), cfg.to_toml()


def run_hosts(ns: argparse.Namespace, rest: list[str]) -> int:
    check_hosts_flags(ns)
    argv, print_config, toml = validate_train_command(rest, ns.hosts, ns.nproc_per_node)
    if print_config:
        sys.stdout.write(toml)
        return 0
    require_root()
    log = get_logger()
    with EmulatedHosts(ns.hosts) as hosts:
        log.info(
            "emulated %d host(s) in namespaces %s*: %s; each runs torchrun --nnodes %d --nproc-per-node %d "
            "--rdzv-endpoint %s:%d",
            hosts.n,
            hosts.prefix,
            ", ".join(f"{hosts.name(i)}={hosts.address(i)}" for i in range(hosts.n)),
            hosts.n,
            ns.nproc_per_node,
            hosts.name(0),
            RDZV_PORT,
        )
        end = run_torchrun_job(hosts, ns.nproc_per_node, ["-m", "isthmus", *argv], out=sys.stdout, timeout_s=ns.timeout)
    return exit_code(end, ns.timeout)


def exit_code(end: JobEnd, timeout_s: float | None) -> int:
    """0, or the one line for how the job ended (raised) with its exit code: the failed host's (its
    first failed rank's), 128 + N for signal N, 3 for a time limit passed."""
    if end.code == 0:
        return 0
    if end.code > 128 and end.host is None:
        signum = end.code - 128
        name = signal.Signals(signum).name if signum in signal.valid_signals() else f"signal {signum}"
        raise Interrupted(signum, f"interrupted ({name}): every host's ranks were stopped and the hosts removed")
    if end.code == 124 and end.host is None:
        raise RunFailed(f"the run on emulated hosts passed its --timeout of {timeout_s:g} s and was stopped")
    error = RunFailed(
        f"the run on emulated hosts failed: host{end.host}'s torchrun ended first ({end.how}); "
        "every host was stopped; its ranks' output is above"
    )
    error.exit_code = end.code
    raise error
