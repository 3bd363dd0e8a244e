"""The planner's choice for a run: partial layouts, local ranks, ``--parallel.plan auto``.

- :func:`choose_layout` runs the search with the ``[parallel]`` values a run names fixed and returns
  the best layout that has them (or the simplest of those near it);
- :func:`local_topology` describes N local ranks on this machine's cores (from the ``local``
  preset or an ``isthmus profile`` file), threads and time-slicing included;
- :func:`choose_local_layout` is ``--parallel.plan auto``: the best layout for ``parallel.nproc``
  local ranks, as ``parallel.*`` values, and a one-line summary; :func:`apply_local_choice`
  also writes it into the config.

Pure Python like the planner: nothing here starts a process or imports torch.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from isthmus.errors import ConfigError
from isthmus.layout import rules
from isthmus.layout.spec import LayoutSpec
from isthmus.models.args import ModelArgs
from isthmus.models.resolve import expected_vocab, resolve_model_args
from isthmus.planner.cost import Estimate
from isthmus.planner.pipeline import check_pipeline
from isthmus.planner.search import SearchSpace, search
from isthmus.planner.topology import DeviceKind, Topology, load_topology, parse_topology, shipped_topologies_dir
from isthmus.planner.workload import Runtime

PLAN_KEYS: tuple[str, ...] = tuple(
    key for f in fields(LayoutSpec) if (key := LayoutSpec.config_key(f.name)) and not key.startswith("geo.")
)
"""The config keys ``--parallel.plan auto`` chooses: the layout's, but for ``[geo]`` (it plans the
local ranks of one datacenter). One the command line names stays fixed."""


def _space_with(space: SearchSpace, fixed: dict[str, Any]) -> SearchSpace:
    """The search space with what ``fixed`` names kept (a schedule means nothing without a pipeline)."""
    pins = {k: v for k, v in fixed.items() if k != "nproc"}
    if pins.get("pp") == 1:
        pins.pop("pp_schedule", None)
        pins.pop("pp_virtual_stages", None)
    return replace(space, fixed={**space.fixed, **pins})


def choose_layout(
    args: ModelArgs,
    topo: Topology,
    space: SearchSpace,
    fixed: dict[str, Any],
    runtime: Runtime,
    dtype: str,
    top: int = 10,
    band: float = 0.0,
) -> Estimate:
    """The best layout whose ``[parallel]`` values include ``fixed`` (the search keeps them:
    :class:`SearchSpace`). With ``band`` > 0, the simplest layout (:func:`mechanisms`) among those
    within ``band`` of the best tokens/s wins instead."""
    if "nproc" in fixed and fixed["nproc"] != topo.n_devices:
        topo = topo.subset(fixed["nproc"])
    pinned = _space_with(space, fixed)
    pool = search(args, topo, pinned, runtime, top=top, dtype=dtype).ranked
    best = pool[0]
    if band > 0:
        near = [e for e in pool if e.effective_tokens_per_s >= (1 - band) * best.effective_tokens_per_s]
        best = min(near, key=lambda e: (mechanisms(e.layout), -e.effective_tokens_per_s))
    lay = best.layout
    why = check_pipeline(
        lay.pp_schedule, lay.pp, lay.microbatches, lay.pp_virtual_stages, args.n_layers, runtime.megatron_stages
    )
    assert why is None, why
    return best


def mechanisms(lay: LayoutSpec) -> int:
    """How many parallel mechanisms a layout runs: tp, sp, cp, pp (and its interleaving), sharding
    (and its stage), gradient accumulation. Each brings runtime work the cost model does not see."""
    return sum(
        [
            lay.tp > 1,
            lay.sequence_parallel,
            lay.cp > 1,
            lay.pp > 1,
            lay.pp_virtual_stages > 1,
            lay.shard_degree > 1,
            lay.grad_accum > 1,
        ]
    ) + (lay.zero_stage - 1 if lay.shard_degree > 1 else 0)


# --- local ranks ---------------------------------------------------------------------------------------

SIMPLEST_WITHIN = 0.05
"""``--parallel.plan auto`` takes the simplest layout within this much of the best predicted tokens/s.

On CPU ranks the cost model separates the top layouts by a few % (small models: 1-2%), less than
what it leaves out: torch's per-op work for DTensor (tp), FSDP2's per-group copies and collectives,
the pipelining runtime's per-action work. Among near-ties, fewer mechanisms is the safer bet."""

THREAD_EFFICIENCY = 0.9
"""Speed-up per extra thread of one rank, when no profile says (2 threads ~ 1.8 x one)."""


def local_runtime() -> Runtime:
    """isthmus on CPU ranks: gloo moves and reduces bytes on the same cores that compute, so
    data-parallel traffic does not hide behind the backward (it adds to the step), unlike on GPUs
    where NCCL runs on its own engines: a dp_replicate 2 step takes compute + all-reduce
    (benchmarks/plan_vs_measured.py).
    Its blocks keep what eager fp32 autograd keeps (``Runtime.eager_llama_block``, measured), and
    tensor parallelism sums through shared memory where the profile measured that path
    (``Runtime.tp_host_memory``)."""
    from isthmus.planner.workload import RUNTIMES

    return replace(
        RUNTIMES["isthmus"], name="isthmus-cpu", dp_overlap=False, eager_llama_block=True, tp_host_memory=True
    )


def threads_per_rank(nproc: int, cores: int | None = None, threads: int = 0) -> int:
    """What the local launcher gives each rank (``train.threads``, else cores // ranks, at least 1)."""
    return threads or max(1, (cores or os.cpu_count() or 1) // max(1, nproc))


def local_topology(nproc: int, source: str = "local", threads: int = 0, cores: int | None = None) -> Topology:
    """``nproc`` local ranks as one node of ``nproc`` devices, from a topology file for this machine.

    A rank with t threads runs at the profile's t-thread rate (a ``[devices.<kind>-<t>t]`` kind
    written by ``isthmus profile``), else t x ``THREAD_EFFICIENCY`` of one thread; more ranks than
    cores time-slice them, so each rank's compute and its gloo traffic get cores / ranks of a core.
    """
    path = Path(source)
    if not path.is_file():
        path = shipped_topologies_dir() / f"{source.removesuffix('.toml')}.toml"
    raw = tomllib.loads(path.read_text()) if path.is_file() else {}
    base = load_topology(source)
    dc = base.datacenters[0]
    cores = cores or os.cpu_count() or 1
    t = threads_per_rank(nproc, cores, threads)
    kind = dc.kind
    threaded = f"{kind.name}-{t}t"
    if t > 1 and threaded in raw.get("devices", {}):
        kind = (
            parse_topology({**raw, "datacenters": [{**raw["datacenters"][0], "device": threaded}]}).datacenters[0].kind
        )
    elif t > 1:
        kind = _scaled(kind, t * THREAD_EFFICIENCY, f"{kind.name}-{t}t")
    busy = nproc * t
    if busy > cores:  # time-sliced: each rank gets cores / (ranks x threads) of its threads' time
        share = cores / busy
        kind = _scaled(kind, share, f"{kind.name}/{busy / cores:g}")
        links = {
            k: replace(getattr(dc, k), bandwidth=getattr(dc, k).bandwidth * share)
            for k in ("intra_node", "fabric", "host_memory")
            if getattr(dc, k) is not None
        }
    else:
        links = {}
    node = replace(dc, kind=kind, nodes=1, devices_per_node=nproc, **links)
    return replace(base, name=f"{base.name} x{nproc}", datacenters=(node,), wan={})


def _scaled(kind: DeviceKind, factor: float, name: str) -> DeviceKind:
    """A kind whose compute and memory bandwidth are ``factor`` times ``kind``'s (its per-block
    runtime work, CPU time too, takes 1 / ``factor`` as long)."""
    return replace(
        kind,
        name=name,
        peak_flops={k: v * factor for k, v in kind.peak_flops.items()},
        memory_bandwidth=kind.memory_bandwidth * factor,
        tp_block_s=kind.tp_block_s / factor,
        sp_block_s=kind.sp_block_s / factor,
        shard_block_s=kind.shard_block_s / factor,
    )


@dataclass(frozen=True)
class LocalChoice:
    parallel: dict[str, Any]
    """``parallel.*`` values to run with (nproc included)."""
    train: dict[str, Any]
    """``train.grad_accum``."""
    summary: str
    estimate: Estimate


def apply_local_choice(cfg: Any, fixed: dict[str, Any] | None = None, world_size: int | None = None) -> LocalChoice:
    """``--parallel.plan auto`` in one call: choose, write the choice into ``cfg``, re-validate.

    ``fixed``: ``[parallel]`` values the user named on the command line; the choice keeps them.
    ``world_size``: the launcher's, under torchrun (else ``parallel.nproc``). Plans for
    ``parallel.plan_topology`` (the ``local`` preset or an ``isthmus profile`` file). Returns the
    choice; print its ``summary``.
    """
    from isthmus.config import set_value, validate

    g = cfg.geo
    if g.datacenters > 1 or g.sync != "none" or g.fault_tolerant:
        raise ConfigError(
            "parallel.plan",
            "auto",
            "plans the local ranks of one datacenter; set the layout by hand "
            "with geo.*, or plan it with isthmus plan --topology ... --json > plan.json and run --parallel.plan plan.json",
        )
    if world_size is not None:
        set_value(cfg, "parallel.nproc", world_size, from_cli=False)
    choice = choose_local_layout(cfg, cfg.parallel.plan_topology, fixed or {})
    for key, value in choice.parallel.items():
        set_value(cfg, f"parallel.{key}", value, from_cli=False)
    for key, value in choice.train.items():
        set_value(cfg, f"train.{key}", value, from_cli=False)
    validate(cfg)
    return choice


def choose_local_layout(cfg: Any, topology: str = "local", fixed: dict[str, Any] | None = None) -> LocalChoice:
    """``--parallel.plan auto``: the planner's best layout of ``cfg``'s model for ``parallel.nproc`` local ranks.

    Keeps ``cfg``'s model, batch, sequence length, dtype, recomputation and compilation; chooses dp_replicate,
    dp_shard, zero_stage, tp, sequence_parallel, cp, pp, pp_schedule, microbatches and
    pp_virtual_stages (and ``train.grad_accum`` when there is no pipeline), keeping what ``fixed``
    names. ``topology``: the ``local`` preset or a file from ``isthmus profile``.
    """

    p, t = cfg.parallel, cfg.train
    args = resolve_model_args(cfg.model, expected_vocab(cfg.data))
    try:
        topo = local_topology(p.nproc, topology, t.threads)
    except ConfigError as e:
        raise ConfigError("parallel.plan_topology", topology, e.rule) from None
    space = SearchSpace(
        {"activation_checkpoint": p.activation_checkpoint, "dc_axis": "none"},
        batch_size=t.batch_size,
        seq_len=t.seq_len,
    )
    if args.tie_embeddings:
        # A tied head cannot be pipelined; the config's model is kept as given.
        space = replace(space, fixed={**space.fixed, "pp": 1})
    chosen = {key.split(".", 1)[1] for key in PLAN_KEYS}
    pins = {k: v for k, v in (fixed or {}).items() if k in chosen and k != "activation_checkpoint"}
    _check_pins(pins, args, p.nproc)
    if pins.get("pp", 1) > 1 and args.tie_embeddings:
        raise ConfigError(
            "parallel.pp",
            pins["pp"],
            "cannot be combined with model.tie_embeddings (embedding and head live on different stages)",
        )
    try:
        runtime = local_runtime().with_compile(t.compile)
        est = choose_layout(
            args, topo, space, {**pins, "nproc": p.nproc}, runtime, t.dtype, top=50, band=SIMPLEST_WITHIN
        )
    except ConfigError as e:
        if not pins:
            raise
        named = ",".join(f"{k}={v}" for k, v in pins.items())
        # The search names the fixed value at fault by its flag (--parallel.tp for tp): keep it.
        rule = e.rule if e.key == "--topology" else f"{e.key} = {e.value!r}: {e.rule}"
        raise ConfigError(
            "parallel.plan", "auto", f"no layout of {p.nproc} local rank(s) with {named} fits ({rule})"
        ) from None
    lay = est.layout
    parallel = {k: v for k, v in lay.parallel_config().items() if k != "activation_checkpoint"}
    train = {"grad_accum": lay.grad_accum}
    summary = (
        f"plan auto: {lay.label()} on {p.nproc} local rank(s) ({topo.datacenters[0].kind.name}): "
        f"predicted {est.step_time_s:.3g} s/step, {est.tokens_per_s:,.0f} tokens/s, "
        f"{est.mem_per_device_gb:.2f} GB/rank"
    )
    return LocalChoice(parallel, train, summary, est)


def _check_pins(pins: dict[str, Any], args: ModelArgs, nproc: int) -> None:
    """The layout rules a fixed value can break on its own, in the trainer's words, before the search."""
    for key in ("dp_replicate", "dp_shard", "tp", "cp", "pp"):
        rules.raise_for(rules.divides_world(key, pins.get(key, 1), nproc))
    rules.raise_for(rules.tensor_parallel_heads(pins.get("tp", 1), args.n_heads, args.n_kv_heads))
    rules.raise_for(rules.pipeline_stages(pins.get("pp", 1), pins.get("pp_virtual_stages", 1), args.n_layers))
