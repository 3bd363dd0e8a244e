"""The `isthmus` command line: the one place that writes to the console.

Every failure a user can cause or meet becomes one line on stderr and the exit code of
`isthmus.errors` (2 bad input, 3 a run that failed, 128 + N a signal).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Sequence

from isthmus.errors import EXIT_INTERRUPTED, EXIT_USAGE, ConfigError, Interrupted, IsthmusError

if TYPE_CHECKING:
    from isthmus.config import JobConfig


class _ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the problem (not a usage block)."""

    def error(self, message: str) -> NoReturn:
        raise IsthmusError(f"{self.prog}: {message}")


def shipped_configs_dir() -> Path:
    return Path(__file__).parent / "configs"


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


LATEST_RUN = "runs/latest"
"""The newest run of the default train.run_dir (a link `isthmus train` updates)."""
_KEY_HELP = "secret key file (default: $ISTHMUS_CHECKPOINT_KEY_FILE): {what} must be signed with it"


def config_name(name: str | None) -> str:
    """What ``{config}`` in train.run_dir becomes: the shipped config's name, or the file's stem."""
    return "default" if name is None else Path(name).stem


def _build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        prog="isthmus",
        description="Train transformer language models in parallel, from one CPU to several datacenters.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_ArgumentParser)
    train = sub.add_parser(
        "train",
        allow_abbrev=False,
        help="train a model (defaults < --config FILE < --section.key VALUE)",
        description="Train a model. Any config key can be overridden as --section.key VALUE, "
        "e.g. --model.flavor tiny --train.steps 20 --metrics.jsonl a.jsonl.",
    )
    train.add_argument("--config", default=None, help="job config TOML file, or a shipped config name (default: default)")
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    gen = sub.add_parser("generate", help="sample text from a trained run or an exported model", allow_abbrev=False)
    model = gen.add_mutually_exclusive_group()
    model.add_argument("--run", help=f"run directory (train.run_dir of the run): its final model (default: {LATEST_RUN})")
    model.add_argument("--model", help="a .safetensors file written by isthmus export")
    gen.add_argument("--prompt", default="def ", help="text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=40)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--key-file", default="", metavar="FILE", help=_KEY_HELP.format(what="an exported file"))
    export = sub.add_parser(
        "export", allow_abbrev=False, help="write a run's model as one .safetensors file that one process loads",
        description="Write a run's model (its final model, else its newest good checkpoint; any layout) as one "
        "safetensors file, with its shape, config and tokenizer in the metadata.",
    )
    export.add_argument("--run", default=LATEST_RUN, help=f"run directory (train.run_dir of the run; default: {LATEST_RUN})")
    export.add_argument("--out", required=True, help="the file to write, FILE.safetensors")
    export.add_argument(
        "--checkpoint", nargs="?", const="latest", default=None, metavar="DIR",
        help="export a checkpoint instead of the final model: the newest good one, or the checkpoint directory DIR",
    )
    export.add_argument(
        "--key-file", default="", metavar="FILE",
        help=_KEY_HELP.format(what="a checkpoint") + "; the exported file is signed with it",
    )
    from isthmus.launch.emulate_cmd import add_parser as add_emulate_parser
    from isthmus.plan_cli import add_plan_parser

    add_plan_parser(sub)
    from isthmus.profile_cli import add_profile_parser
    from isthmus.sim_cli import add_simulate_parser

    add_simulate_parser(sub)
    add_profile_parser(sub)

    add_emulate_parser(sub)
    return parser


def train_config(config: str | None, rest: list[str], print_config: bool = False, announce: bool = True) -> JobConfig:
    """The validated config of ``isthmus train [--config CONFIG] REST``, as this process would run it
    (under torchrun its RANK / WORLD_SIZE count). ``announce``: print the planner's choice when
    ``parallel.plan = auto`` (as a TOML comment with ``print_config``)."""
    from isthmus.config import build_config, parse_overrides
    from isthmus.preflight import preflight

    overrides = parse_overrides(rest)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and all(k != "parallel.nproc" for k, _ in overrides):
        # Under torchrun the launcher started the ranks: a config's nproc (the default config's 2) is
        # how many isthmus's own launcher would start, so the launcher's count stands. Named on the
        # command line, nproc must agree with it (checked at launch).
        overrides.append(("parallel.nproc", os.environ["WORLD_SIZE"]))
    cfg = build_config(find_config(config), overrides)
    if cfg.parallel.plan == "auto":
        _plan_auto(cfg, overrides, as_comment=print_config, announce=announce)
    preflight(cfg)
    return cfg


def parse_train_command(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """``train [--config C] [--print-config] --section.key VALUE ...`` as `isthmus train` parses it:
    its options and the overrides left."""
    return _build_parser().parse_known_args(argv)


def _cmd_train(ns: argparse.Namespace, rest: list[str]) -> int:
    cfg = train_config(ns.config, rest, print_config=ns.print_config)
    if ns.print_config:
        sys.stdout.write(cfg.to_toml())
        return 0
    from isthmus.launch.local import launch, launched_externally
    from isthmus.log import setup_logging

    setup_logging()
    result = launch(cfg, config_name(ns.config))
    if not launched_externally() or os.environ.get("RANK") == "0":
        _print_summary(result)
    return 0


def _plan_auto(cfg: object, overrides: list[tuple[str, str]], as_comment: bool, announce: bool = True) -> None:
    """``--parallel.plan auto``: the planner sets the layout; what the command line names stays fixed.

    The choice is printed first (as a TOML comment above ``--print-config``'s output)."""
    from isthmus.autoplan import PLAN_KEYS, apply_local_choice

    named = {key.split(".", 1)[1] for key, _ in overrides if key.startswith("parallel.")}
    fixed = {k: getattr(cfg.parallel, k) for k in named if k in PLAN_KEYS and k != "nproc"}  # type: ignore[attr-defined]
    fixed = {k: v for k, v in fixed.items() if v != -1}  # a data-parallel degree of -1 is the planner's to choose
    world = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None  # torchrun
    choice = apply_local_choice(cfg, fixed, world)
    if announce and (world is None or os.environ.get("RANK") == "0"):
        sys.stdout.write(("# " if as_comment else "") + choice.summary + "\n")
        sys.stdout.flush()


def _print_summary(result: object) -> None:
    from rich.console import Console
    from rich.table import Table

    r = result
    table = Table(title="isthmus train: done", show_header=False)
    table.add_row("steps", f"{len(r.losses)} on {r.world_size} rank(s)")
    table.add_row("loss first -> last", f"{r.losses[0]:.4f} -> {r.losses[-1]:.4f}")
    if r.val_losses:
        table.add_row("val loss", "  ".join(f"{s}:{v:.4f}" for s, v in r.val_losses))
    table.add_row("throughput", f"{r.tokens_per_s:,.0f} tokens/s, MFU {100 * r.mfu:.1f}%")
    table.add_row("wall time", f"{r.elapsed_s:.1f} s")
    if r.bytes_by_tier:
        from isthmus.geo.accounting import format_bytes

        table.add_row("bytes sent", "  ".join(f"{tier} {format_bytes(n)}" for tier, n in r.bytes_by_tier.items()))
    table.add_row("run dir", str(r.run_dir))
    table.add_row("next", f"isthmus generate --run {r.run_dir} --prompt 'def '")
    Console().print(table)


def _cmd_generate(ns: argparse.Namespace) -> int:
    from isthmus.generate import generate
    from isthmus.train.checkpoint_manifest import checkpoint_key

    if ns.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", ns.max_new_tokens, "must be at least 1")
    if ns.temperature < 0:
        raise ConfigError("--temperature", ns.temperature, "must be 0 (greedy) or positive")
    key = checkpoint_key(ns.key_file, "--key-file")
    text = generate(
        ns.model or ns.run or LATEST_RUN, ns.prompt, ns.max_new_tokens, ns.temperature, ns.top_k, ns.seed, key=key
    )
    sys.stdout.write(text + "\n")
    return 0


def _cmd_export(ns: argparse.Namespace) -> int:
    from isthmus.export import export_run
    from isthmus.log import setup_logging
    from isthmus.train.checkpoint_manifest import checkpoint_key

    setup_logging()  # a skipped damaged checkpoint is a warning line
    done = export_run(ns.run, ns.out, ns.checkpoint, checkpoint_key(ns.key_file, "--key-file"))
    origin = "final model" if done["origin"] == "final" else f"checkpoint {done['origin']} (step {done['step']})"
    sys.stdout.write(
        f"exported the {origin} of {ns.run}: {done['tensors']} tensors, {done['parameters']:,} parameters, "
        f"{done['bytes'] / 1e6:.1f} MB -> {done['out']}\n"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    try:
        if not argv:
            parser.print_help()
            return EXIT_USAGE
        ns, rest = parser.parse_known_args(argv)
        if ns.command == "train":
            return _cmd_train(ns, rest)
        if ns.command == "emulate":
            from isthmus.launch.emulate_cmd import run as run_emulate
            from isthmus.log import setup_logging

            setup_logging()
            return run_emulate(ns, rest[1:] if rest[:1] == ["--"] else rest)
        if rest:
            raise IsthmusError(f"isthmus {ns.command}: unrecognized arguments: {' '.join(rest)}")
        if ns.command == "generate":
            return _cmd_generate(ns)
        if ns.command == "plan":
            from isthmus.plan_cli import run_plan

            return run_plan(ns)
        if ns.command == "simulate":
            from isthmus.sim_cli import run_simulate

            return run_simulate(ns)
        if ns.command == "profile":
            from isthmus.profile_cli import run_profile

            return run_profile(ns)
        if ns.command == "export":
            return _cmd_export(ns)
        parser.print_help()
        return EXIT_USAGE
    except Interrupted as e:
        sys.stderr.write(f"isthmus: {e}\n")
        return e.exit_code
    except IsthmusError as e:
        sys.stderr.write(f"isthmus: error: {e}\n")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("isthmus: interrupted\n")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
