"""`isthmus plan`: search every layout of a model on a topology and print the ranked result.

    isthmus plan --model gpt3-145.6b --model.n_layers 96 --topology geo-3dc-h100 \\
                 --train.batch_size 1536 --train.seq_len 2048 --top 5

Anything not fixed on the command line (training shape, any parallel degree, the schedule, the
cross-datacenter placement and strategy) is left to the search.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

from isthmus.config import WAN_STREAMS_MAX, ModelConfig
from isthmus.errors import ConfigError
from isthmus.layout.choices import ACTIVATION_CHECKPOINTS, DC_AXES, GEO_SYNCS, PP_SCHEDULES, WAN_SCHEDULES
from isthmus.models.resolve import resolve_model_args
from isthmus.planner.explain import explain, format_table, result_json
from isthmus.planner.placement import runnable
from isthmus.planner.search import DEFAULT_BATCH_TOKENS, SPACE_FLAGS, SearchSpace, search
from isthmus.planner.topology import Topology, load_topology
from isthmus.planner.workload import PLANNED_DTYPES, RUNTIMES, Runtime

SHAPE_FLAGS: tuple[tuple[str, type], ...] = (
    ("n_layers", int),
    ("dim", int),
    ("n_heads", int),
    ("n_kv_heads", int),
    ("ffn_dim", int),
    ("vocab_size", int),
)
_POSITIVE = {
    **{key: SPACE_FLAGS[key] for key in ("batch_size", "seq_len", "micro_batch")},
    "top": "--top",
    "gpus": "--gpus",
    "nodes": "--nodes",
    **{
        key: SPACE_FLAGS[key]
        for key in ("tp", "pp", "cp", "dp_shard", "pp_virtual_stages")
        + ("inner_steps", "fragments", "overlap_steps", "datacenters", "max_batch_tokens")
    },
}


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``plan`` sub-command; the parser class (one-line errors) comes from ``subparsers``."""
    p = subparsers.add_parser(
        "plan",
        allow_abbrev=False,
        help="rank every parallel layout of a model on a topology (no GPU needed)",
        description="Search data/tensor/sequence/context/pipeline parallelism, ZeRO stage, microbatching, "
        "recomputation and cross-datacenter placement; print the ranked layouts and why the best one wins.",
    )
    p.add_argument("--model", required=True, metavar="FLAVOR", help="model flavor (e.g. gpt3-145.6b, llama3-70b)")
    for key, typ in SHAPE_FLAGS:
        p.add_argument(
            f"--model.{key}",
            dest=f"model_{key}",
            type=typ,
            default=None,
            metavar="N",
            help=f"override the flavor's {key}",
        )
    p.add_argument(
        "--model.mlp", dest="model_mlp", choices=("swiglu", "gelu"), default=None, help="override the MLP kind"
    )
    p.add_argument(
        "--model.tie_embeddings",
        dest="model_tie_embeddings",
        type=_bool,
        default=None,
        metavar="BOOL",
        help="override whether embedding and head share weights",
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
    # Layout settings take the names `isthmus train` gives them (--section.key); the rest is searched.
    p.add_argument(
        "--train.batch_size",
        dest="batch_size",
        type=int,
        default=None,
        metavar="N",
        help="sequences per step (default: searched)",
    )
    p.add_argument(
        "--train.seq_len",
        dest="seq_len",
        type=int,
        default=None,
        metavar="N",
        help="tokens per sequence (default: searched)",
    )
    p.add_argument(
        "--micro-batch",
        dest="micro_batch",
        type=int,
        default=None,
        metavar="N",
        help="sequences per microbatch, the layout's micro_batch (derived, no config key; default: searched)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        metavar="N",
        help="tokens per step when --train.batch_size is searched (default: 4,194,304)",
    )
    for key in ("tp", "pp", "cp", "dp_shard", "pp_virtual_stages"):
        p.add_argument(f"--parallel.{key}", dest=key, type=int, default=None, metavar="N", help=f"fix parallel.{key}")
    p.add_argument(
        "--parallel.zero_stage", dest="zero_stage", type=int, choices=(1, 2, 3), default=None, help="fix the ZeRO stage"
    )
    p.add_argument(
        "--parallel.pp_schedule",
        dest="pp_schedule",
        choices=PP_SCHEDULES,
        default=None,
        help="fix the pipeline schedule",
    )
    p.add_argument(
        "--parallel.activation_checkpoint",
        dest="activation_checkpoint",
        choices=ACTIVATION_CHECKPOINTS,
        default=None,
        help="fix the activation recomputation",
    )
    p.add_argument(
        "--geo.dc_axis",
        dest="dc_axis",
        choices=DC_AXES,
        default=None,
        help="what crosses datacenters: none (use one), dp replicas or pp stages",
    )
    p.add_argument(
        "--geo.datacenters",
        dest="datacenters",
        type=int,
        default=None,
        metavar="K",
        help="datacenters to use, the K with the most compute (default: searched, every subset size)",
    )
    p.add_argument(
        "--geo.wan_schedule",
        dest="wan_schedule",
        default=None,
        metavar="LIST",
        help="how pipelines share a WAN link at a stage boundary (comma list of "
        f"{', '.join(WAN_SCHEDULES)}; default: both)",
    )
    p.add_argument(
        "--geo.wan_streams",
        dest="wan_streams",
        type=int,
        default=1,
        metavar="N",
        help="TCP connections each cross-datacenter pipeline transfer is split over (default 1; it "
        "matters on WAN links with a window_kib, where one connection carries window / RTT)",
    )
    p.add_argument(
        "--geo.sync",
        dest="sync",
        default=None,
        metavar="LIST",
        help=f"cross-datacenter sync kinds to consider (comma list of {', '.join(GEO_SYNCS)}; default: all)",
    )
    p.add_argument(
        "--geo.inner_steps",
        dest="inner_steps",
        type=int,
        default=100,
        metavar="H",
        help="diloco / streaming_diloco: inner steps between syncs (default: 100)",
    )
    p.add_argument(
        "--geo.fragments",
        dest="fragments",
        type=int,
        default=4,
        metavar="F",
        help="streaming_diloco: fragments synchronised in turn (default: 4)",
    )
    p.add_argument(
        "--geo.overlap_steps",
        dest="overlap_steps",
        type=int,
        default=1,
        metavar="T",
        help="streaming_diloco: inner steps a fragment's transfer overlaps (default: 1)",
    )
    p.add_argument(
        "--train.dtype",
        dest="dtype",
        choices=PLANNED_DTYPES,
        default=None,
        help="matmul dtype (default: the devices' own, bf16 on GPUs, fp32 on CPUs); beyond the fp32 and "
        "bf16 that isthmus trains in, the published runs' tf32, fp16 and fp8 can be planned",
    )
    p.add_argument(
        "--train.compile",
        dest="compile",
        type=_bool,
        default=False,
        metavar="BOOL",
        help="blocks compiled by torch.compile, as isthmus train --train.compile true runs them (default: false)",
    )
    p.add_argument(
        "--runtime",
        choices=tuple(RUNTIMES),
        default="isthmus",
        help="software assumptions (docs/runtimes.md): isthmus (default), megatron-2021, megatron-2022, llama3",
    )
    p.add_argument("--top", type=int, default=10, metavar="K", help="layouts to print (default: 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def planned_runtime(ns: argparse.Namespace) -> Runtime:
    """``--runtime``, with its blocks compiled when ``--train.compile true``."""
    return RUNTIMES[ns.runtime].with_compile(ns.compile)


def check_arguments(ns: argparse.Namespace) -> None:
    for key, flag in _POSITIVE.items():
        value = getattr(ns, key, None)
        if value is not None and value < 1:
            raise ConfigError(flag, value, "must be at least 1")
    for key, _ in SHAPE_FLAGS:
        value = getattr(ns, f"model_{key}")
        if value is not None and value < 1:
            raise ConfigError(f"--model.{key}", value, "must be at least 1")
    if ns.fragments > ns.inner_steps:
        raise ConfigError("--geo.fragments", ns.fragments, f"must be at most --geo.inner_steps = {ns.inner_steps}")
    if ns.overlap_steps >= ns.inner_steps:
        raise ConfigError(
            "--geo.overlap_steps", ns.overlap_steps, f"must be less than --geo.inner_steps = {ns.inner_steps}"
        )
    if ns.wan_bandwidth is not None and not ns.wan_bandwidth > 0:
        raise ConfigError("--wan-bandwidth", ns.wan_bandwidth, "must be positive (GB/s)")


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
    """The search space the shared `plan` / `simulate` flags describe."""

    sync = _comma_choices(ns.sync, GEO_SYNCS, "--geo.sync", allow_empty=True)
    wan = _comma_choices(ns.wan_schedule, WAN_SCHEDULES, "--geo.wan_schedule", allow_empty=False)
    if not 1 <= ns.wan_streams <= WAN_STREAMS_MAX:
        raise ConfigError("--geo.wan_streams", ns.wan_streams, f"must be between 1 and {WAN_STREAMS_MAX}")
    return SearchSpace(
        batch_size=ns.batch_size,
        seq_len=ns.seq_len,
        micro_batch=ns.micro_batch,
        activation_checkpoint=ns.activation_checkpoint,
        tp=ns.tp,
        pp=ns.pp,
        cp=ns.cp,
        dp_shard=ns.dp_shard,
        zero_stage=ns.zero_stage,
        pp_schedule=ns.pp_schedule,
        pp_virtual_stages=ns.pp_virtual_stages,
        dc_axis=ns.dc_axis,
        sync=sync,
        inner_steps=ns.inner_steps,
        fragments=ns.fragments,
        overlap_steps=ns.overlap_steps,
        max_batch_tokens=ns.max_batch_tokens or DEFAULT_BATCH_TOKENS,
        datacenters=ns.datacenters,
        wan_schedule=wan,
        wan_streams=ns.wan_streams,
    )


def run(ns: argparse.Namespace, rest: list[str] | None = None) -> int:
    """Run the search for a parsed ``plan`` command and print the result; 0 on success."""

    check_arguments(ns)
    overrides = {key: getattr(ns, f"model_{key}") for key, _ in SHAPE_FLAGS}
    model = ModelConfig(flavor=ns.model, mlp=ns.model_mlp, tie_embeddings=ns.model_tie_embeddings, **overrides)
    args = resolve_model_args(model)
    topo = cli_topology(ns)
    space = search_space(ns)
    dtype = ns.dtype or topo.datacenters[0].kind.default_dtype
    result = search(args, topo, space, planned_runtime(ns), top=ns.top, dtype=dtype)
    if ns.json:
        sys.stdout.write(json.dumps(result_json(result, topo, ns.top), indent=2) + "\n")
        return 0
    best = result.best.work
    sys.stdout.write(
        f"isthmus plan: {ns.model} on {topo.name} ({topo.n_devices:,} devices), global batch {best.batch_size} x "
        f"{best.seq_len} tokens; {result.considered:,} layouts considered, {result.pruned_memory:,} over memory\n\n"
    )
    sys.stdout.write(format_table(result, ns.top) + "\n")
    what_ifs = [str(i) for i, est in enumerate(result.ranked[: ns.top], 1) if runnable(topo, est.layout) is not None]
    if what_ifs:
        sys.stdout.write(f"planner-only what-ifs (the runtime cannot run them as placed): #{', #'.join(what_ifs)}\n")
    sys.stdout.write("\n")
    sys.stdout.write(textwrap.fill(explain(result, topo), width=100, break_on_hyphens=False) + "\n")
    return 0
