"""`isthmus plan`: search every layout of a model on a topology and print the ranked result.

    isthmus plan --model.flavor gpt3-145.6b --model.n_layers 96 --topology geo-3dc-h100 \\
                 --train.batch_size 1536 --train.seq_len 2048 --top 5

Anything not fixed on the command line (training shape, any parallel degree, the schedule, the
cross-datacenter placement and strategy) is left to the search.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import fields, replace
from typing import Any, Literal, get_args, get_origin

from isthmus.cli.config_keys import attribute_docs
from isthmus.config import WAN_STREAMS_MAX, JobConfig, ModelConfig
from isthmus.errors import ConfigError
from isthmus.layout.choices import DILOCO_SYNCS, GEO_SYNCS, WAN_SCHEDULES
from isthmus.layout.spec import LABEL_LEGEND, LayoutSpec, legend_for
from isthmus.layout.syncs import MIN_SYNCS, sparse_syncs
from isthmus.models.resolve import resolve_model_args
from isthmus.planner.explain import explain, format_table, result_json, trades
from isthmus.planner.search import CHOICE_LISTS, DEFAULT_BATCH_TOKENS, SETTINGS, SearchSpace, flag_of, search
from isthmus.planner.topology import Topology, load_topology
from isthmus.planner.workload import DEFAULT_GPU_RUNTIME, FEATURES, PLANNED_DTYPES, RUNTIMES, Runtime

MODEL_KEYS = ("flavor", "n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "mlp", "tie_embeddings")
"""The ``[model]`` keys a plan reads: the flavor and its shape (the others change no plan)."""
SEARCHED_TRAIN_KEYS = ("batch_size", "seq_len")
"""``[train]`` keys the search chooses when not given."""
LAYOUT_FLAGS = tuple(f.name for f in fields(LayoutSpec) if LayoutSpec.config_key(f.name) is not None)
"""Every layout field with a config key: a flag named as the key, which fixes the field."""
OWN_INT_FLAGS = {"micro_batch": "--micro-batch", "max_batch_tokens": "--max-batch-tokens"}
OTHER_INT_FLAGS = {"top": "--top", "gpus": "--gpus", "nodes": "--nodes", "steps": "--train.steps"}


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def refused(rule: str) -> type[argparse.Action]:
    """An argparse action for a flag an earlier version took: refused in one line, ``rule`` naming
    what replaced it."""

    class Refused(argparse.Action):
        def __call__(
            self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any, option: Any = None
        ) -> None:
            raise ConfigError(str(option), values, rule)

    return Refused


def _typed(tp: Any) -> dict[str, Any]:
    """argparse's ``type`` / ``choices`` / ``metavar`` for a config field's type (``X | None`` as X)."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in get_args(tp) if a is not type(None))
    if get_origin(tp) is Literal:
        return {"choices": get_args(tp)}
    if tp is bool:
        return {"type": _bool, "metavar": "BOOL"}
    if tp is int:
        return {"type": int, "metavar": "N"}
    return {"type": tp}


def _config_flag(p: argparse.ArgumentParser, dotted: str, tp: Any, doc: str, dest: str, **extra: Any) -> None:
    """``--section.key``, typed as the field, its help the field's docstring (without its markup)."""
    plain = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc).replace("``", "")
    p.add_argument(f"--{dotted}", dest=dest, **{"default": None, **_typed(tp), "help": plain, **extra})


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``plan`` sub-command; the parser class (one-line errors) comes from ``subparsers``.

    Its settings are flags named as ``isthmus train``'s (``--section.key``), typed and documented by
    the config's dataclasses: the model's flavor and shape, the batch, precision and compilation, and
    every layout field (:class:`LayoutSpec`), which fixes it; what is not given is searched."""
    p = subparsers.add_parser(
        "plan",
        allow_abbrev=False,
        help="rank every parallel layout of a model on a topology (no GPU needed)",
        description="Search data/tensor/sequence/context/pipeline parallelism, ZeRO stage, microbatching, "
        "recomputation and cross-datacenter placement; print the ranked layouts and why the best one wins.",
    )
    model_hints, model_docs = typing.get_type_hints(ModelConfig), attribute_docs(ModelConfig)
    for key in MODEL_KEYS:
        doc = model_docs[key] + (" (required)" if key == "flavor" else "")
        extra = {"required": True, "metavar": "FLAVOR"} if key == "flavor" else {}
        _config_flag(p, f"model.{key}", model_hints[key], doc, f"model_{key}", **extra)
    p.add_argument(
        "--model", action=refused("is written --model.flavor now, as isthmus train names it"), help=argparse.SUPPRESS
    )
    p.add_argument(
        "--topology", default="local", metavar="FILE|PRESET", help="topology TOML file or preset (default: local)"
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=None,
        metavar="N",
        help="give every datacenter of the topology N nodes (grow a preset past its file's size)",
    )
    p.add_argument("--gpus", type=int, default=None, metavar="N", help="use only the first N devices of the topology")
    p.add_argument(
        "--wan-bandwidth", type=float, default=None, metavar="GB/S", help="replace every WAN link's bandwidth"
    )
    train_hints, train_docs = typing.get_type_hints(type(JobConfig().train)), attribute_docs(type(JobConfig().train))
    for key in SEARCHED_TRAIN_KEYS:
        _config_flag(p, f"train.{key}", train_hints[key], f"{train_docs[key]} (default: searched)", key)
    _config_flag(
        p,
        "train.steps",
        int,
        f"{train_docs['steps']} The run's length: geo.inner_steps, where not fixed, syncs at least "
        f"{MIN_SYNCS} times in it (default: a long run)",
        "steps",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        metavar="N",
        help="tokens per step when --train.batch_size is searched (default: 4,194,304)",
    )
    p.add_argument(
        "--micro-batch",
        dest="micro_batch",
        type=int,
        default=None,
        metavar="N",
        help="sequences per microbatch, the layout's micro_batch (derived, no config key; default: searched)",
    )
    layout_hints, layout_docs = typing.get_type_hints(LayoutSpec), attribute_docs(LayoutSpec)
    sections = {s: attribute_docs(type(getattr(JobConfig(), s))) for s in ("parallel", "geo", "train")}
    for name in LAYOUT_FLAGS:
        dotted = LayoutSpec.config_key(name)
        assert dotted is not None
        doc = layout_docs.get(name) or sections[dotted.split(".")[0]][name]
        if name in CHOICE_LISTS:
            words = getattr(SearchSpace(), name)
            _config_flag(
                p,
                dotted,
                str,
                f"{doc} (a comma list of {', '.join(words)} to consider; default: all)",
                name,
                metavar="LIST",
            )
        elif name in SETTINGS:
            _config_flag(p, dotted, layout_hints[name], f"{doc} (default: {SETTINGS[name]})", name)
        else:
            _config_flag(p, dotted, layout_hints[name], f"{doc} (fixes it; default: searched)", name)
    p.add_argument(
        "--train.dtype",
        dest="dtype",
        choices=PLANNED_DTYPES,
        default=None,
        help="matmul dtype (default: the devices' own, bf16 on GPUs, fp32 on CPUs); beyond the fp32 and "
        "bf16 that isthmus trains in, the published runs' tf32, fp16 and fp8 can be planned",
    )
    _config_flag(p, "train.compile", bool, f"{train_docs['compile']} (default: false)", "compile", default=False)
    p.add_argument(
        "--runtime",
        choices=tuple(RUNTIMES),
        default=None,
        help=f"the software's features as a preset (docs/runtimes.md): {DEFAULT_GPU_RUNTIME} (today's stacks; "
        "the default on GPU topologies), isthmus (what isthmus runs; the default on CPU topologies), or a "
        "published era: torchtitan, megatron-2021, megatron-2022, megatron-deepspeed, megatron-core, llama3",
    )
    runtime_hints = typing.get_type_hints(Runtime)
    for feature, doc in FEATURES.items():
        p.add_argument(
            f"--runtime.{feature}",
            dest=f"runtime_{feature}",
            default=None,
            **_typed(runtime_hints[feature]),
            help=f"{doc} (default: the preset's)",
        )
    p.add_argument(
        "--expert-imbalance",
        type=float,
        default=None,
        metavar="X",
        help="MoE models: tokens the most loaded expert receives over the mean, >= 1 (default: the runtime's, "
        f"{RUNTIMES['current'].expert_imbalance}; docs/moe-planning.md)",
    )
    p.add_argument("--top", type=int, default=10, metavar="K", help="layouts to print (default: 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--legend", action=_Legend, help="print what every part of a layout label means, and exit (nothing else needed)"
    )
    return p


class _Legend(argparse.Action):
    """``--legend``: prints :func:`legend_text` and exits, like ``--help``, before required flags are checked."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        sys.stdout.write(legend_text() + "\n")
        parser.exit(0)


def sync_note(layout: LayoutSpec, steps: int | None) -> str | None:
    """For a layout that syncs by DiLoCo, how often in a run of ``steps`` (``--train.steps``): a
    warning when it syncs fewer than MIN_SYNCS times (geo.inner_steps fixed above the cap), the run
    length the interval needs when no length is given; None otherwise."""
    if layout.dc_axis != "dp" or layout.sync not in DILOCO_SYNCS:
        return None
    if steps is None:
        return (
            f"sync: geo.inner_steps = {layout.inner_steps} syncs {MIN_SYNCS} times in a run of at least "
            f"{MIN_SYNCS * layout.inner_steps} steps; give --train.steps N to plan a shorter run"
        )
    why = sparse_syncs(layout.inner_steps, steps)
    return None if why is None else f"warning: {why}"


def legend_text() -> str:
    """Every part of a layout label, what it means and the config keys it shows (LABEL_LEGEND)."""
    width = max(len(part.token) for part in LABEL_LEGEND)
    lines = ["Layout labels, part by part, left to right (N: a number):"]
    for part in LABEL_LEGEND:
        text = part.means + (f" [{part.keys}]" if part.keys else "")
        lines.append(
            textwrap.fill(text, 100, initial_indent=f"  {part.token:<{width}}  ", subsequent_indent=" " * (width + 4))
        )
    return "\n".join(lines)


def legend_line(labels: list[str]) -> str:
    """The legend entries ``labels`` use, in a few words each: the line under the table."""
    words = "; ".join(f"{part.token} {part.short}" for part in legend_for(labels))
    return textwrap.fill(f"labels: {words} (isthmus plan --legend says more)", 100, break_on_hyphens=False)


def default_runtime(topo: Topology) -> str:
    """The preset a topology's plans assume unless ``--runtime`` names one: today's stacks on GPUs,
    isthmus itself on CPU topologies (kinds whose default dtype is fp32), the only software there."""
    cpu = all(dc.kind.default_dtype == "fp32" for dc in topo.datacenters)
    return "isthmus" if cpu else DEFAULT_GPU_RUNTIME


def assumed_features(runtime: Runtime, dtype: str) -> str:
    """One line: the runtime preset and what it does, as plan and simulate print it."""
    return f"{runtime.name} ({', '.join(runtime.feature_words(dtype))}); set with --runtime.<feature>"


def planned_runtime(ns: argparse.Namespace, topo: Topology) -> Runtime:
    """``--runtime`` (or the topology's default) with its ``--runtime.<feature>`` flags, its blocks
    compiled when ``--train.compile true``, and ``--expert-imbalance``."""
    chosen = {f: getattr(ns, f"runtime_{f}") for f in FEATURES if getattr(ns, f"runtime_{f}", None) is not None}
    runtime = RUNTIMES[ns.runtime or default_runtime(topo)].with_features(**chosen).with_compile(ns.compile)
    if ns.expert_imbalance is not None:
        runtime = replace(runtime, expert_imbalance=ns.expert_imbalance)
    return runtime


def _int_flags() -> Iterator[tuple[str, str]]:
    """(dest, flag) of every integer flag: each must be at least 1."""
    model_hints = typing.get_type_hints(ModelConfig)
    yield from ((f"model_{k}", f"--model.{k}") for k in MODEL_KEYS if _typed(model_hints[k]).get("type") is int)
    yield from ((k, f"--train.{k}") for k in SEARCHED_TRAIN_KEYS)
    layout_hints = typing.get_type_hints(LayoutSpec)
    yield from ((k, flag_of(k)) for k in LAYOUT_FLAGS if layout_hints[k] is int)
    yield from OWN_INT_FLAGS.items()
    yield from OTHER_INT_FLAGS.items()


def check_arguments(ns: argparse.Namespace) -> None:
    for dest, flag in _int_flags():
        value = getattr(ns, dest, None)
        if value is not None and value < 1:
            raise ConfigError(flag, value, "must be at least 1")
    if ns.expert_imbalance is not None and not ns.expert_imbalance >= 1.0:
        raise ConfigError("--expert-imbalance", ns.expert_imbalance, "must be at least 1 (1 = balanced experts)")
    if ns.zero_stage not in (None, 1, 2, 3):
        raise ConfigError(flag_of("zero_stage"), ns.zero_stage, "must be 1, 2 or 3")
    if ns.outer_density is not None and not 0 < ns.outer_density <= 1:
        raise ConfigError(flag_of("outer_density"), ns.outer_density, "must be in (0, 1]")
    if ns.wan_bandwidth is not None and not ns.wan_bandwidth > 0:
        raise ConfigError("--wan-bandwidth", ns.wan_bandwidth, "must be positive (GB/s)")


def model_config(ns: argparse.Namespace) -> ModelConfig:
    """The ``[model]`` the flags name: the flavor and any of its shape overridden."""
    return ModelConfig(**{key: getattr(ns, f"model_{key}") for key in MODEL_KEYS})


def _comma_choices(raw: str | None, choices: tuple[str, ...], flag: str, allow_empty: bool) -> tuple[str, ...]:
    """A flag's comma list of choices (all of them when the flag is not given); ConfigError naming the
    first that is not one, or an empty list where one is needed."""
    picked = choices if raw is None else tuple(x.strip() for x in raw.split(",") if x.strip())
    for x in picked or (() if allow_empty else ("",)):
        if x not in choices:
            raise ConfigError(flag, x, f"choose from: {', '.join(choices)}")
    return picked


def cli_topology(ns: argparse.Namespace) -> Topology:
    """The topology the flags describe: the file or preset, grown or shrunk to ``--nodes`` nodes per
    datacenter, cut to its first ``--gpus`` devices, its WAN links at ``--wan-bandwidth``."""
    topo = load_topology(ns.topology)
    if ns.nodes is not None:
        topo = topo.with_nodes(ns.nodes)
    if ns.gpus is not None:
        topo = topo.subset(ns.gpus)
    if ns.wan_bandwidth is not None:
        topo = topo.with_wan(bandwidth_gb_s=ns.wan_bandwidth)
    return topo


def search_space(ns: argparse.Namespace) -> SearchSpace:
    """The search space the shared `plan` / `simulate` flags describe: each layout flag given fixes its field."""

    fixed = {k: getattr(ns, k) for k in (*LAYOUT_FLAGS, "micro_batch") if k not in CHOICE_LISTS}
    space = SearchSpace(
        {k: v for k, v in fixed.items() if v is not None},
        batch_size=ns.batch_size,
        seq_len=ns.seq_len,
        max_batch_tokens=ns.max_batch_tokens or DEFAULT_BATCH_TOKENS,
        sync=_comma_choices(ns.sync, GEO_SYNCS, flag_of("sync"), allow_empty=True),
        wan_schedule=_comma_choices(ns.wan_schedule, WAN_SCHEDULES, flag_of("wan_schedule"), allow_empty=False),
        steps=ns.steps,
    )
    inner, fragments, overlap = (space.setting(k) for k in ("inner_steps", "fragments", "overlap_steps"))
    if fragments > inner:
        raise ConfigError(flag_of("fragments"), fragments, f"must be at most {flag_of('inner_steps')} = {inner}")
    if overlap >= inner:
        raise ConfigError(flag_of("overlap_steps"), overlap, f"must be less than {flag_of('inner_steps')} = {inner}")
    if not 1 <= space.setting("wan_streams") <= WAN_STREAMS_MAX:
        raise ConfigError(
            flag_of("wan_streams"), space.setting("wan_streams"), f"must be between 1 and {WAN_STREAMS_MAX}"
        )
    return space


def run(ns: argparse.Namespace, rest: list[str] | None = None) -> int:
    """Run the search for a parsed ``plan`` command and print the result; 0 on success."""

    check_arguments(ns)
    args = resolve_model_args(model_config(ns))
    topo = cli_topology(ns)
    space = search_space(ns)
    dtype = ns.dtype or topo.datacenters[0].kind.default_dtype
    runtime = planned_runtime(ns, topo)
    result = search(args, topo, space, runtime, top=ns.top, dtype=dtype)
    note = sync_note(result.best.layout, ns.steps)
    if ns.json:
        sys.stdout.write(json.dumps({**result_json(result, topo, ns.top), "sync_note": note}, indent=2) + "\n")
        return 0
    best = result.best.work
    sys.stdout.write(
        f"isthmus plan: {ns.model_flavor} on {topo.name} ({topo.n_devices:,} devices), global batch {best.batch_size} x "
        f"{best.seq_len} tokens; {result.considered:,} layouts considered, {result.pruned_memory:,} over memory\n"
        f"assumed software: {assumed_features(runtime, dtype)}\n\n"
    )
    sys.stdout.write(format_table(result, ns.top, topo) + "\n")
    shown = [est.layout.label() for est in result.ranked[: ns.top] + result.what_ifs[: ns.top]]
    sys.stdout.write(legend_line(shown) + "\n" + (f"{note}\n" if note else "") + "\n")
    sys.stdout.write(textwrap.fill(explain(result, topo), width=100, break_on_hyphens=False) + "\n")
    lines = trades(result, topo)
    if lines:
        sys.stdout.write("\n" + "\n".join(lines) + "\n")
    return 0
