"""`isthmus train`: build the job config (defaults < TOML < --section.key), check it, launch, summarise."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from isthmus.cli.common import subcommand_parser
from isthmus.cli.config_keys import help_text
from isthmus.config import JobConfig, build_config, parse_overrides
from isthmus.errors import ConfigError, IsthmusError
from isthmus.launch.environ import launcher_world, said_once_per_host
from isthmus.launch.preflight import preflight
from isthmus.launch.warm import start_rank_server, starts_local_ranks
from isthmus.layout.choices import DILOCO_SYNCS
from isthmus.layout.syncs import sparse_syncs
from isthmus.log import setup_logging
from isthmus.planner.autoplan import PLAN_KEYS, apply_local_choice

if TYPE_CHECKING:
    from isthmus.train.trainer import TrainResult


def add_parser(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser(
        "train",
        allow_abbrev=False,
        help="train a model (defaults < --config FILE < --section.key VALUE)",
        description="Train a model. Any config key can be overridden as --section.key VALUE, "
        "e.g. --model.flavor tiny --train.steps 20 --metrics.jsonl a.jsonl.",
        epilog=help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument(
        "--config", default=None, help="job config TOML file, or a shipped config name (default: default)"
    )
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def shipped_configs_dir() -> Path:
    return Path(__file__).parents[1] / "configs"


def find_config(name: str | None) -> Path:
    """A config path as given, or the name of a shipped config (``default``, ``tiny``...)."""
    if name is None:
        return shipped_configs_dir() / "default.toml"
    path = Path(name)
    if path.is_file():
        return path
    shipped = shipped_configs_dir() / (name if name.endswith(".toml") else f"{name}.toml")
    if shipped.is_file():
        return shipped
    available = ", ".join(sorted(p.stem for p in shipped_configs_dir().glob("*.toml")))
    raise ConfigError("--config", name, f"file not found (shipped configs: {available})")


def config_name(name: str | None) -> str:
    """What ``{config}`` in train.run_dir becomes: the shipped config's name, or the file's stem."""
    return "default" if name is None else Path(name).stem


def train_config(config: str | None, rest: list[str], print_config: bool = False, announce: bool = True) -> JobConfig:
    """The validated config of ``isthmus train [--config CONFIG] REST``, as this process would run it
    (under torchrun its RANK / WORLD_SIZE count). ``announce``: print the planner's choice when
    ``parallel.plan = auto`` (as a TOML comment with ``print_config``)."""
    overrides = parse_overrides(rest)
    world = launcher_world()
    if world is not None and all(k != "parallel.nproc" for k, _ in overrides):
        # Under torchrun the launcher started the ranks: a config's nproc (the default config's 2) is
        # how many isthmus's own launcher would start, so the launcher's count stands. Named on the
        # command line, nproc must agree with it (checked at launch).
        overrides.append(("parallel.nproc", str(world)))
    cfg = build_config(find_config(config), overrides)
    if cfg.parallel.plan == "auto":
        _plan_auto(cfg, overrides, as_comment=print_config, announce=announce)
    preflight(cfg)
    why = sparse_syncs(cfg.geo.inner_steps, cfg.train.steps) if syncs_by_diloco(cfg) else None
    if why is not None and (world is None or os.environ.get("RANK") == "0"):
        # A warning, not an error: a short trial of a long run's config is a fair thing to start.
        sys.stderr.write(f"warning: {why}\n")
    return cfg


def syncs_by_diloco(cfg: JobConfig) -> bool:
    """Whether the run's datacenters average their models every geo.inner_steps steps."""
    return cfg.geo.datacenters > 1 and cfg.geo.sync in DILOCO_SYNCS


def parse_train_command(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """``train [--config C] [--print-config] --section.key VALUE ...`` as `isthmus train` parses it:
    its options and the overrides left."""
    parser, sub = subcommand_parser()
    add_parser(sub)
    return parser.parse_known_args(argv)


def run(ns: argparse.Namespace, rest: list[str]) -> int:
    try:
        cfg = train_config(ns.config, rest, print_config=ns.print_config)
    except IsthmusError as e:  # under torchrun on several hosts: once per host, naming it
        raise said_once_per_host(e, named=False) from None
    if ns.print_config:
        sys.stdout.write(cfg.to_toml())
        return 0
    if starts_local_ranks(cfg):
        start_rank_server()  # the ranks' interpreter imports torch beside this one (`isthmus.launch.warm`)
    # Startup time: torch loads (seconds) only once a run really starts, not for --print-config or an error.
    from isthmus.launch.local import launch, launched_externally

    setup_logging()
    result = launch(cfg, config_name(ns.config))
    if not launched_externally() or os.environ.get("RANK") == "0":
        _print_summary(result)
    return 0


def _plan_auto(cfg: JobConfig, overrides: list[tuple[str, str]], as_comment: bool, announce: bool = True) -> None:
    """``--parallel.plan auto``: the planner sets the layout; what the command line names stays fixed.

    The choice is printed first (as a TOML comment above ``--print-config``'s output)."""

    named = [key.split(".", 1) for key, _ in overrides if key in PLAN_KEYS]
    fixed = {k: getattr(getattr(cfg, section), k) for section, k in named}
    fixed = {k: v for k, v in fixed.items() if v != -1}  # a data-parallel degree of -1 is the planner's to choose
    world = launcher_world()
    choice = apply_local_choice(cfg, fixed, world)
    if announce and (world is None or os.environ.get("RANK") == "0"):
        sys.stdout.write(("# " if as_comment else "") + choice.summary + "\n")
        sys.stdout.flush()


def _print_summary(r: TrainResult) -> None:
    from isthmus.geo.accounting import format_bytes  # loads torch; the run has loaded it already

    table = Table(title="isthmus train: done", show_header=False)
    table.add_row("steps", f"{len(r.losses)} on {r.world_size} rank(s)")
    table.add_row("loss first -> last", f"{r.losses[0]:.4f} -> {r.losses[-1]:.4f}")
    if r.val_losses:
        table.add_row("val loss", "  ".join(f"{s}:{v:.4f}" for s, v in r.val_losses))
    table.add_row("throughput", f"{r.tokens_per_s:,.0f} tokens/s, MFU {100 * r.mfu:.1f}%")
    if r.peak_flops > 0:
        table.add_row(
            "MFU from",
            f"{r.flops_per_device / 1e9:,.1f} of {r.peak_flops / 1e9:,.1f} GFLOP/s per device; peak: {r.peak_source}",
        )
    table.add_row("wall time", f"{r.elapsed_s:.1f} s")
    if r.bytes_by_tier:
        table.add_row("bytes sent", "  ".join(f"{tier} {format_bytes(n)}" for tier, n in r.bytes_by_tier.items()))
    table.add_row("run dir", str(r.run_dir))
    table.add_row("next", f"isthmus generate --run {r.run_dir} --prompt 'def '")
    Console().print(table)
