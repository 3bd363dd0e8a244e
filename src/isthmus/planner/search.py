"""Search every valid layout of a workload on a topology, prune, and rank by throughput.

The space: datacenters used (1, every subset size k with the k largest, or all; see
``placement.choose_dcs``) and which axis crosses them (dp or pp; with pp, stage counts in proportion
to the datacenters' compute and every device used, as Atlas places them, besides even counts, and
the WAN schedule, fair or time-shared), tp (a divisor of the node that
divides the heads), cp, pp, the dp_replicate x dp_shard split and ZeRO stage, microbatch size and
count, pipeline schedule and virtual stages, recomputation, and the cross-datacenter strategy.
Pruning, in order: rules the runtime enforces (``pipeline.check_pipeline``, ZeRO-1 alone); a
memory floor before any timing; dominance (sequence parallelism whenever tp > 1: same bytes, less
memory, less redundant elementwise work; GPipe only where 1F1B cannot run); and branch and bound:
core layouts (all but the dp split, ZeRO stage and geo strategy) go best bound first; a core's
stage costs, then its variants, are computed only while its bound can still enter the top k or beat
the best layout of its kind of WAN crossing. The bounds are true upper bounds on tokens/s, so the
top k is what exhaustive evaluation gives.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from isthmus.errors import ConfigError
from isthmus.layout.choices import DILOCO_SYNCS, GEO_SYNCS, PP_COMPRESSIONS, WAN_SCHEDULES
from isthmus.layout.rules import expert_parallel, zero_stage, zero_stages
from isthmus.layout.spec import LayoutSpec
from isthmus.layout.syncs import inner_steps_cap
from isthmus.models.args import ModelArgs
from isthmus.models.flops import count_params
from isthmus.planner import comm
from isthmus.planner.compression import not_chosen
from isthmus.planner.compute import BlockShape, act_bytes, layer_times
from isthmus.planner.cost import (
    Estimate,
    StageCost,
    estimate,
    pipeline_links,
    rank_memory,
    recompute_share,
    stage_costs,
)
from isthmus.planner.memory import (
    USABLE_FRACTION,
    MemoryBreakdown,
    fsdp_mixed_precision,
    gathered_weight_bytes,
    model_state_bytes,
    moe_state_bytes,
    stage_expert_params,
    stage_params,
)
from isthmus.planner.pipeline import check_pipeline, pipeline_time
from isthmus.planner.placement import Placement, PlacementCache, choose_dcs, runnable
from isthmus.planner.topology import Datacenter, Topology
from isthmus.planner.workload import Runtime, Workload

DEFAULT_SEQ_LENS = (2048, 4096, 8192)
DEFAULT_BATCH_TOKENS = 4 * 1024 * 1024
MICRO_BATCHES = (1, 2, 4, 8, 16)
MIN_CP_TOKENS = 2048
"""Context parallelism only splits sequences into pieces of at least this many tokens."""


SETTINGS: dict[str, object] = {
    "inner_steps": 100,
    "fragments": 4,
    "overlap_steps": 1,
    "wan_streams": 1,
    "pp_early_recv": True,
    "pp_compression_rank": 32,
    "outer_dtype": "auto",
    "outer_density": 0.02,
}
"""Layout fields the search never chooses but sets on every layout, at these values unless fixed
(inner_steps: the planner's 100, where the config's default is 50; for a run of ``train.steps``,
at most what syncs ``isthmus.layout.syncs.MIN_SYNCS`` times, see :meth:`SearchSpace.setting`)."""
CHOICE_LISTS = ("sync", "wan_schedule")
"""Layout fields the search takes a list of choices for (:class:`SearchSpace`'s own fields), not one value."""


@dataclass(frozen=True)
class SearchSpace:
    """What the search may choose: a :class:`LayoutSpec` field in ``fixed`` keeps its value, the rest
    is searched."""

    fixed: Mapping[str, Any] = field(default_factory=dict)
    """Layout fields and their values. The search pins those it enumerates (degrees, schedule,
    ZeRO stage, microbatch size, recomputation, placement), keeps only the layouts that have the
    others (dp_replicate, cp_impl, microbatches, grad_accum) and sets the :data:`SETTINGS` on every
    layout; sequence_parallel, where not fixed, is taken wherever tp > 1. Not the :data:`CHOICE_LISTS`."""
    batch_size: int | None = None
    seq_len: int | None = None
    max_batch_tokens: int = DEFAULT_BATCH_TOKENS
    """Tokens per step when batch_size is left to the search."""
    sync: tuple[str, ...] = GEO_SYNCS
    """The cross-datacenter sync kinds to consider (geo.sync)."""
    wan_schedule: tuple[str, ...] = WAN_SCHEDULES
    """How pipelines share a WAN link at a stage boundary (geo.wan_schedule) to consider."""
    steps: int | None = None
    """train.steps, the run's length: caps DiLoCo's inner_steps where not fixed (None: a long run)."""

    def __post_init__(self) -> None:
        names = {f.name for f in fields(LayoutSpec)} - set(CHOICE_LISTS)
        unknown = sorted(set(self.fixed) - names)
        if unknown:
            raise ValueError(f"the search cannot fix {', '.join(unknown)} (it fixes: {', '.join(sorted(names))})")

    def pin(self, name: str) -> Any:
        """The value ``fixed`` gives a layout field, or None (searched)."""
        return self.fixed.get(name)

    def setting(self, name: str) -> Any:
        """A field of :data:`SETTINGS`: as fixed, else its planning value. For a run of ``steps``,
        inner_steps syncs at least :data:`~isthmus.layout.syncs.MIN_SYNCS` times (:func:`inner_steps_cap`), and
        Streaming DiLoCo's fragments and overlap steps fit in it."""
        if name in self.fixed or self.steps is None or name not in ("inner_steps", "fragments", "overlap_steps"):
            return self.fixed.get(name, SETTINGS[name])
        planned: dict[str, int] = {k: v for k, v in SETTINGS.items() if isinstance(v, int)}
        inner = self.fixed.get("inner_steps", min(planned["inner_steps"], inner_steps_cap(self.steps)))
        fitted = {"inner_steps": inner, "fragments": min(planned["fragments"], inner)}
        return fitted.get(name, min(planned["overlap_steps"], inner - 1))

    def keeps(self, lay: LayoutSpec, names: Iterable[str]) -> bool:
        """Whether ``lay`` has the fixed value of each of ``names`` that is fixed."""
        return all(getattr(lay, n) == self.fixed[n] for n in names if n in self.fixed)


def flag_of(name: str) -> str:
    """The flag of `isthmus plan` / `simulate` that sets a layout field or a :class:`SearchSpace` field,
    as errors name it: the config key's (``--parallel.tp``), else the planner's own."""
    key = LayoutSpec.config_key(name) or {"batch_size": "train.batch_size", "seq_len": "train.seq_len"}.get(name)
    return f"--{key}" if key else "--" + name.replace("_", "-")


@dataclass
class SearchResult:
    ranked: list[Estimate]
    """The layouts the runtime runs as placed (:func:`runnable`), best first by effective tokens/s;
    the planner's what-ifs instead when none of them runs (a subset of the datacenters fixed)."""
    runtime: Runtime
    """The software every estimate assumed."""
    considered: int = 0
    pruned_memory: int = 0
    alternatives: dict[str, Estimate] = field(default_factory=dict)
    """Best layout per family ('dc_axis=pp', 'datacenters=2', 'sync=diloco', 'tp=4', ...) for explanations."""
    what_ifs: list[Estimate] = field(default_factory=list)
    """Layouts the runtime cannot run as placed that beat the best of ``ranked``, best first: the
    planner's what-ifs (a subset of the datacenters, unequal stage counts), kept apart."""
    least_over: MemoryBreakdown | None = None
    """Of the layouts refused as over memory, the fullest device of the one that came closest (its
    first pipeline rank's floor where the refusal came before any timing): why nothing fits."""

    def over_memory(self, mem: MemoryBreakdown) -> None:
        """Count a layout refused as over memory, keeping the smallest such device."""
        self.pruned_memory += 1
        if self.least_over is None or mem.total < self.least_over.total:
            self.least_over = mem

    @property
    def best(self) -> Estimate:
        return self.ranked[0]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _placements(topo: Topology, space: SearchSpace) -> list[tuple[int, str]]:
    """(datacenters, axis): one datacenter, or k of n (the k largest) cut along dp or pp."""
    n = len(topo.datacenters)
    opts = [(1, "none")] + [(k, axis) for k in range(2, n + 1) for axis in ("dp", "pp")]
    return [o for o in opts if space.pin("dc_axis") in (None, o[1]) and space.pin("datacenters") in (None, o[0])]


def _schedules(space: SearchSpace, pp: int, m: int, layers: int, runtime: Runtime) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out: list[tuple[str, int]] = []
    for sched in ("1f1b", "interleaved_1f1b", "zero_bubble", "gpipe"):
        if space.pin("pp_schedule") not in (None, sched):
            continue
        vs = [1] if sched in ("1f1b", "gpipe") else ([2] if sched == "zero_bubble" else [2, 3, 4, 8])
        if sched == "interleaved_1f1b" and space.pin("pp_virtual_stages") is not None:
            vs = [space.pin("pp_virtual_stages")]  # any depth the user names, where check_pipeline allows it
        for v in vs:
            if space.pin("pp_virtual_stages") not in (None, v) or check_pipeline(
                sched, pp, m, v, layers, runtime.megatron_stages
            ):
                continue
            if sched == "gpipe" and space.pin("pp_schedule") is None and any(s == "1f1b" for s, _ in out):
                continue  # same time as 1F1B, more memory
            out.append((sched, v))
    return out


def _fix(choices: list[int], fixed: int | None) -> list[int]:
    return [c for c in choices if fixed is None or c == fixed]


def search(
    args: ModelArgs, topo: Topology, space: SearchSpace, runtime: Runtime, top: int = 10, dtype: str = "bf16"
) -> SearchResult:
    """The ``top`` best layouts that fit in memory; ConfigError when none does."""
    if space.pin("activation_checkpoint") == "selective" and runtime.selective is None:
        raise ConfigError(
            flag_of("activation_checkpoint"), "selective", f"runtime {runtime.name} has no selective recomputation"
        )
    if space.pin("ep") is not None:
        # What the model alone rules out (a dense model, experts that ep does not divide); that ep
        # divides dp_shard x cp is each layout's rule.
        ruled_out = expert_parallel(space.pin("ep"), space.pin("ep"), 1, args.n_experts)
        if ruled_out is not None:
            raise ConfigError(flag_of("ep"), space.pin("ep"), str(ruled_out))
    datacenters, dc_axis = space.pin("datacenters"), space.pin("dc_axis")
    if datacenters is not None and not 1 <= datacenters <= len(topo.datacenters):
        raise ConfigError(
            flag_of("datacenters"),
            datacenters,
            f"topology {topo.name!r} has {len(topo.datacenters)} datacenter(s)",
        )
    if not _placements(topo, space):
        if datacenters is not None:
            raise ConfigError(flag_of("datacenters"), datacenters, f"does not go with {flag_of('dc_axis')} {dc_axis}")
        raise ConfigError(flag_of("dc_axis"), dc_axis, f"topology {topo.name!r} has one datacenter; use none")
    heap = _Ranking(top, len(topo.datacenters))
    result = SearchResult([], runtime)
    counter = 0
    cores: list[_Core] = []
    for work, core, usable in _core_layouts(args, topo, space, runtime, dtype):
        cand = _prepare(work, topo, core, runtime, space, usable, result)
        if cand is not None:
            cores.append(cand)
    # Best bound first, so the top k fills early; a core is evaluated while its bound may still enter
    # the top k or beat the best layout of its kind of WAN crossing (for the explanation).
    cores.sort(key=lambda c: -c.bound)
    placed = PlacementCache(topo)
    for cand in cores:
        if _hopeless(cand, heap, result, len(topo.datacenters)):
            continue
        _tighten(cand, placed, runtime, space)
        if _hopeless(cand, heap, result, len(topo.datacenters)):
            continue
        counter = _variants(cand, topo, placed, runtime, space, heap, result, counter)
    if not heap.every:
        n = count_params(args)
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        why = (
            f"fits in device memory ({result.considered} considered, {result.pruned_memory} over memory"
            + (
                f"; closest, first rank: {memory_parts(result.least_over, usable_bytes(topo))}"
                if result.least_over
                else ""
            )
            + ")"
            if result.considered
            else "is valid for this model's shape and the search's fixed values"
        )
        if not result.considered:
            _name_the_fixed_value(args, topo, space, runtime, dtype, f"{size}-parameter model")
        raise ConfigError("--topology", topo.name, f"no layout of this {size}-parameter model {why}")
    result.ranked, result.what_ifs = heap.sections()
    return result


class _Ranking:
    """The top k layouts overall and the top k of those the runtime runs as placed (two heaps of
    (effective tokens/s, -arrival, estimate)): a what-if never hides the best layout that runs."""

    def __init__(self, top: int, datacenters: int) -> None:
        self.top, self.datacenters = top, datacenters
        self.every: list[tuple[float, int, Estimate]] = []
        self.runs: list[tuple[float, int, Estimate]] = []
        self.why: dict[int, str | None] = {}

    def offer(self, item: tuple[float, int, Estimate], why: str | None) -> None:
        """Keep ``item`` where it ranks; ``why``: :func:`runnable`'s reason it is a what-if, or None."""
        self.why[item[1]] = why
        for heap, kept in ((self.every, True), (self.runs, why is None)):
            if not kept:
                continue
            if len(heap) < self.top:
                heapq.heappush(heap, item)
            elif item[0] > heap[0][0]:
                heapq.heapreplace(heap, item)

    def may_enter(self, bound: float, datacenters: int) -> bool:
        """Whether a layout of at most ``bound`` tokens/s over ``datacenters`` can still be kept."""
        if len(self.every) < self.top or bound >= self.every[0][0]:
            return True
        if 1 < datacenters < self.datacenters:  # a subset of the datacenters never runs as placed
            return False
        return len(self.runs) < self.top or bound >= self.runs[0][0]

    def sections(self) -> tuple[list[Estimate], list[Estimate]]:
        """(the layouts that run, best first; the what-ifs that beat the best of them, best first);
        the what-ifs first when none runs."""
        order = sorted(self.every, key=lambda x: (-x[0], x[1]))
        runs = [est for _, _, est in sorted(self.runs, key=lambda x: (-x[0], x[1]))]
        if not runs:
            return [est for _, _, est in order], []
        floor = runs[0].effective_tokens_per_s
        return runs, [est for tps, n, est in order if self.why[n] is not None and tps > floor]


def _core_layouts(
    args: ModelArgs, topo: Topology, space: SearchSpace, runtime: Runtime, dtype: str
) -> Iterator[tuple[Workload, LayoutSpec, float]]:
    """Every core layout the runtime's rules and the space allow (no dp split, ZeRO stage or geo
    strategy yet), with its workload and the usable bytes of its devices."""
    seqs = [space.seq_len] if space.seq_len else list(DEFAULT_SEQ_LENS)
    for seq in seqs:
        for dc, axis in _placements(topo, space):
            used = [topo.datacenters[i] for i in _used(topo, dc)]
            per_dc = min(d.devices for d in used)
            world = per_dc * dc
            node = min(d.devices_per_node for d in used)
            usable = min(d.kind.memory_bytes for d in used) * USABLE_FRACTION
            for tp in _fix(
                [t for t in divisors(node) if args.n_heads % t == 0 and args.n_kv_heads % t == 0], space.pin("tp")
            ):
                # Short sequence pieces and odd microbatch sizes are left out of the search, not
                # refused: a value the user names is tried whatever the search would have chosen.
                cps = [
                    c
                    for c in divisors(per_dc // tp)
                    if seq % (2 * c) == 0 and (c == 1 or seq // c >= MIN_CP_TOKENS or c == space.pin("cp"))
                ]
                for cp in _fix(cps, space.pin("cp")):
                    if args.is_moe and args.capacity_factor > 0 and cp > 1:
                        continue  # a sequence's capacity would count tokens on other cp ranks: refused
                    sp = _sequence_parallel(space, runtime, tp, cp, seq)
                    if sp is None:
                        continue
                    for pp, dp in _pipelines(used, axis, world, tp, cp, args.n_layers, space.pin("pp")):
                        for mb in _micro_batch_sizes(space, dp, pp):
                            m = _microbatches(space, seq, dp, mb, pp)
                            if m is None:
                                continue
                            work = Workload(args, dp * mb * m, seq, dtype)
                            for sched, v in _schedules(space, pp, m, args.n_layers, runtime):
                                for rc in (
                                    [space.pin("activation_checkpoint")]
                                    if space.pin("activation_checkpoint")
                                    else ["none", "full"]
                                    if runtime.selective is None
                                    else ["none", "selective", "full"]
                                ):
                                    for impl in _cp_impls(args, tp, cp):
                                        core = LayoutSpec(
                                            tp=tp,
                                            sequence_parallel=sp,
                                            cp=cp,
                                            cp_impl=impl,  # type: ignore[arg-type]
                                            pp=pp,
                                            pp_schedule=sched,  # type: ignore[arg-type]
                                            pp_virtual_stages=v,
                                            dp_replicate=dp // (dc if axis == "dp" else 1),
                                            micro_batch=mb,
                                            microbatches=m if pp > 1 else 1,
                                            grad_accum=1 if pp > 1 else m,
                                            activation_checkpoint=rc,  # type: ignore[arg-type]
                                            datacenters=dc,
                                            dc_axis=axis,  # type: ignore[arg-type]
                                            # The bound takes the faster schedule; variants try each.
                                            wan_schedule=_wan_schedules(axis, space)[-1],  # type: ignore[arg-type]
                                            wan_streams=space.setting("wan_streams"),
                                        )
                                        if space.keeps(core, _MATCHED):
                                            yield work, core, usable


def _sequence_parallel(space: SearchSpace, runtime: Runtime, tp: int, cp: int, seq: int) -> bool | None:
    """Sequence parallelism wherever the runtime has it and tp > 1 (the same bytes, less memory, less
    redundant elementwise work), or as fixed; None where a fixed true cannot run."""
    can = runtime.sequence_parallel and tp > 1 and seq % (tp * cp) == 0
    want = space.pin("sequence_parallel")
    if want is None:
        return can
    return None if want and not can else bool(want)


def _has_valid_layout(args: ModelArgs, topo: Topology, space: SearchSpace, runtime: Runtime, dtype: str) -> bool:
    """Whether any layout passes the runtime's rules and the space's fixed values (memory aside)."""
    for _, core, _ in _core_layouts(args, topo, space, runtime, dtype):
        if any(
            _zero_choices(core, shard, space) and _expert_choices(args, shard, core.cp, space)
            for shard in _shard_choices(core, space)
        ):
            return True
    return False


def _shard_choices(core: LayoutSpec, space: SearchSpace) -> list[int]:
    """The dp_shard degrees a core's data parallelism inside one datacenter allows, as the space fixes them."""
    cut = core.datacenters if core.dc_axis == "dp" else 1
    per_dc = core.dp // cut
    return [
        s for s in _fix(divisors(per_dc), space.pin("dp_shard")) if space.pin("dp_replicate") in (None, per_dc // s)
    ]


def _name_the_fixed_value(
    args: ModelArgs, topo: Topology, space: SearchSpace, runtime: Runtime, dtype: str, what: str
) -> None:
    """When no layout is valid, raise for the fixed value that rules them all out, if one does alone:
    the user learns which flag to change, not only that the combination fails."""
    culprits = [
        (flag_of(name), value)
        for name, value in [*space.fixed.items(), ("batch_size", space.batch_size), ("seq_len", space.seq_len)]
        if value is not None
        and name not in SETTINGS
        and _has_valid_layout(args, topo, _without(space, name), runtime, dtype)
    ]
    if len(culprits) == 1:
        flag, value = culprits[0]
        raise ConfigError(
            flag, value, f"no valid layout of this {what} on {topo.name} has it; without it the search finds some"
        )
    if culprits:
        named = ", ".join(f"{flag} {value}" for flag, value in culprits)
        raise ConfigError(
            "--topology", topo.name, f"no layout of this {what} is valid with {named} together; drop one of them"
        )


def _without(space: SearchSpace, name: str) -> SearchSpace:
    """``space`` with ``name`` (a fixed layout field, batch_size or seq_len) left to the search."""
    if name == "batch_size":
        return replace(space, batch_size=None)
    if name == "seq_len":
        return replace(space, seq_len=None)
    return replace(space, fixed={k: v for k, v in space.fixed.items() if k != name})


def _cp_impls(args: ModelArgs, tp: int, cp: int) -> list[str]:
    """Ring always; Ulysses when cp divides the heads of a tensor-parallel rank."""
    if cp == 1:
        return ["ring"]
    return ["ring", "ulysses"] if (args.n_heads // tp) % cp == 0 and (args.n_kv_heads // tp) % cp == 0 else ["ring"]


def _used(topo: Topology, dc: int) -> list[int]:
    return choose_dcs(topo, LayoutSpec(datacenters=dc))


def _pipelines(
    used: list[Datacenter], axis: str, world: int, tp: int, cp: int, n_layers: int, fixed: int | None
) -> list[tuple[int, int]]:
    """(pp, dp) pairs on the used datacenters: ``world`` (the smallest one's devices in each) split
    evenly, and with dc_axis = 'pp' also every device of each used: stage counts in proportion
    to the datacenters (Atlas; the same pairs when they are alike)."""
    k = len(used)
    pairs = [(p, world // (tp * cp * p)) for p in divisors(world // (tp * cp)) if p <= n_layers]
    if axis == "dp":
        pairs = [(p, d) for p, d in pairs if d % k == 0]
    if axis == "pp":
        pairs = [(p, d) for p, d in pairs if p % k == 0 and p >= k]
        smallest = min(u.devices for u in used)
        for d in divisors(smallest // (tp * cp)):
            p = sum(u.devices // (tp * cp * d) for u in used)
            if p <= n_layers and (p, d) not in pairs:
                pairs.append((p, d))
    return [(p, d) for p, d in pairs if fixed in (None, p)]


def _posts_ahead(core: LayoutSpec, wan_schedule: str) -> bool:
    """Whether the runtime can post this layout's WAN receives ahead (``geo.pp_early_recv``'s rules)."""
    return core.dc_axis == "pp" and wan_schedule == "fair" and core.pp_schedule in ("gpipe", "1f1b")


def _wan_schedules(axis: str, space: SearchSpace) -> list[str]:
    """WAN schedules to try, fair first: only pipeline boundaries (dc_axis = 'pp') have one to choose."""
    if axis != "pp":
        return ["fair"]
    return [w for w in WAN_SCHEDULES if w in space.wan_schedule] or ["fair"]


def _micro_batch_sizes(space: SearchSpace, dp: int, pp: int) -> list[int]:
    """Microbatch sizes to try: as fixed; the one a fixed count of microbatches (or accumulated
    passes, without a pipeline) leaves of a fixed batch; else :data:`MICRO_BATCHES`."""
    if space.pin("micro_batch"):
        return [space.pin("micro_batch")]
    count = space.pin("microbatches") if pp > 1 else space.pin("grad_accum")
    if count and space.batch_size:
        return [space.batch_size // (dp * count)] if space.batch_size % (dp * count) == 0 else []
    return list(MICRO_BATCHES)


def _microbatches(space: SearchSpace, seq: int, dp: int, mb: int, pp: int) -> int | None:
    if space.batch_size is not None:
        if space.batch_size % (dp * mb):
            return None
        return space.batch_size // (dp * mb)
    m = space.max_batch_tokens // (seq * dp * mb)
    if m < 1:
        return None
    return m // pp * pp if m >= pp else m


@dataclass
class _Core:
    """A layout without its dp split, ZeRO stage and geo strategy, with what those do not change."""

    work: Workload
    core: LayoutSpec
    bound: float
    """Effective tokens/s no variant can beat: from compute alone, then from the pipeline phase."""
    shards: list[int]
    first_params: float
    first_act: float
    first_experts: float
    usable: float
    stages: list[StageCost] | None = None
    placement: Placement | None = None
    compressed_stages: dict[str, list[StageCost]] = field(default_factory=dict)
    """Stage costs of the core with each lossy ``pp_compression`` the search tries (dc_axis = pp)."""


def _prepare(
    work: Workload,
    topo: Topology,
    core: LayoutSpec,
    runtime: Runtime,
    space: SearchSpace,
    usable: float,
    result: SearchResult,
) -> _Core | None:
    """Memory floor and a compute-only bound of a core layout; None when no variant of it can fit."""
    shards = [s for s in _shard_choices(core, space) if _expert_choices(work.args, s, core.cp, space)]
    if not shards:
        # The fixed dp_shard does not divide this core's data parallelism: no variant, and not a
        # matter of memory (counted as one, it showed an unsharded "closest" below the limit).
        return None
    p = core.pp
    # Memory floor: the first rank (most microbatches in flight) with at least its share of layers
    # less one; activations do not depend on the dp split but through whether FSDP2 holds the
    # weights: isthmus's bf16 then computes under FSDP's mixed precision, whose block keeps less
    # than autocast's (bf16 norm inputs and residual, no per-matmul casts, no cached weight
    # copies), so the FSDP figure is the floor for every split.
    layers = max(core.pp_virtual_stages, work.args.n_layers // p - (1 if p > 1 else 0))
    first_params = stage_params(work.args, layers, True, p == 1, p) / core.tp
    first_experts = stage_expert_params(work.args, layers) / core.tp
    # A MoE core is bounded at its widest expert parallelism and balanced experts: the fewest weights
    # held and gathered, the largest (most efficient) expert GEMMs, no waiting on a loaded expert.
    widest_ep = max(max(_expert_choices(work.args, shard, core.cp, space), default=1) for shard in shards)
    floor_rt = replace(runtime, expert_imbalance=1.0) if work.args.is_moe else runtime
    floor_core = core.with_(ep=widest_ep) if work.args.is_moe else core
    first_mem = rank_memory(
        work, floor_core, floor_rt, 0, layers, True if fsdp_mixed_precision(runtime, work.dtype, True) else None
    )
    first_act = first_mem.activations + first_mem.transient
    widest = max(shards) * core.cp
    state = model_state_bytes(first_params, 3, widest, runtime, False, 1)
    if sum(state) + first_act > usable:
        result.considered += 1
        result.over_memory(MemoryBreakdown(*state, first_mem.activations, first_mem.transient))
        return None
    # A lower bound of the pipeline phase without placing anything: every block's compute and
    # tensor-parallel all-reduces on the fastest datacenter, and the bubble that even stages leave
    # ((m + (p-1)/v) of a mean stage; zero-bubble schedules may fill it).
    rc = recompute_share(core.activation_checkpoint, runtime)  # 0 for attention-core recomputation: still a bound
    act = core.micro_batch * work.seq_len / core.cp * work.args.dim * act_bytes(work.dtype)
    block = min(
        t.fwd * (1 + rc) + t.backward + (2 + rc) * 2 * comm.all_reduce(act, comm.local_span(core.tp, d.intra_node))
        for d, t in (
            (
                d,
                layer_times(d.kind, BlockShape.of(work, floor_core), floor_rt),
            )
            for d in (topo.datacenters[i] for i in _used(topo, core.datacenters))
        )
    )
    fill = 0.0 if core.pp_schedule == "zero_bubble" else (p - 1) / core.pp_virtual_stages
    floor = (core.microbatches_per_step + fill) * work.args.n_layers / p * block
    best_q = max(runtime.quality_of(g) for g in _geos(core, space))
    return _Core(
        work, core, work.tokens_per_step / floor * best_q, shards, first_params, first_act, first_experts, usable
    )


def _expert_choices(args: ModelArgs, shard: int, cp: int, space: SearchSpace) -> list[int]:
    """Expert-parallel degrees (``layout.rules.expert_parallel``) for a shard group, as the space fixes
    them, smallest first: 1 for a dense model."""
    if not args.is_moe:
        return [1] if space.pin("ep") in (None, 1) else []
    return [
        e for e in _fix(divisors(shard * cp), space.pin("ep")) if expert_parallel(e, shard, cp, args.n_experts) is None
    ]


def _tighten(cand: _Core, placed: PlacementCache, runtime: Runtime, space: SearchSpace) -> None:
    """Stage costs (shared by every variant: they depend on tp, cp, pp and microbatching only) and the
    bound of the pipeline phase with free data parallelism."""
    core, work = cand.core, cand.work
    cand.placement = placed(core)
    cand.stages = stage_costs(work, core, runtime, cand.placement)
    for method in _compressions(core, space)[1:]:
        cand.compressed_stages[method] = stage_costs(
            work, core.with_(**_compression_fields(method, space)), runtime, cand.placement
        )
    if work.args.is_moe:
        # These stages are ep 1's; a wider ep may run faster (larger expert GEMMs), so the compute
        # bound of `_prepare` stays the bound.
        return
    # Compressed boundaries trade encoding time for WAN time: the bound is the fastest of them.
    t_floor = min(
        pipeline_time(
            [s.total for s in stages],
            [s.wgrad for s in stages],
            core.microbatches_per_step,
            core.pp_virtual_stages,
            core.pp_schedule,
            pipeline_links(work, lay, runtime, cand.placement, [s.total for s in stages]),
        )[0]
        for lay, stages in _compressed_cores(cand, space)
    )
    cand.bound = min(
        cand.bound, work.tokens_per_step / t_floor * max(runtime.quality_of(g) for g in _geos(core, space))
    )


def _hopeless(cand: _Core, heap: _Ranking, result: SearchResult, n: int) -> bool:
    """No variant can enter the top k (overall or of the layouts that run), nor beat the best of its
    WAN crossing or, over every datacenter, the best that uses them all (both explain the winner)."""
    if heap.may_enter(cand.bound, cand.core.datacenters):
        return False
    keys = [f"dc_axis={cand.core.dc_axis}"]
    if cand.core.datacenters == n and n > 1:
        keys.append(f"datacenters={n}")
    for key in keys:
        rival = result.alternatives.get(key)
        if rival is None or cand.bound >= rival.effective_tokens_per_s:
            return False
    return True


def _compressions(core: LayoutSpec, space: SearchSpace) -> list[str]:
    """The pipeline-boundary compressions to try, exact first: where stage boundaries cross
    datacenters, the lossy methods whose measured loss the quality table accepts
    (:func:`~isthmus.planner.compression.not_chosen`), or the one fixed; exact elsewhere. The others
    are what-ifs, priced for the best pipeline across datacenters only (``explain.trades``): trying
    them all would multiply the layouts the search evaluates (a looser bound on every such core)."""
    fixed = space.pin("pp_compression")
    if fixed is not None or core.dc_axis != "pp" or core.pp == 1:
        return [fixed or "none"]
    fields = _compression_fields("none", space)
    accepted = [m for m in PP_COMPRESSIONS[1:] if not_chosen(core.with_(**{**fields, "pp_compression": m})) is None]
    return ["none", *accepted]


def _compression_fields(method: str, space: SearchSpace) -> dict[str, Any]:
    return {"pp_compression": method, "pp_compression_rank": space.setting("pp_compression_rank")}


def _compressed_cores(cand: _Core, space: SearchSpace) -> Iterator[tuple[LayoutSpec, list[StageCost]]]:
    """(the core with each compression the search tries, its stage costs)."""
    assert cand.stages is not None
    for method in _compressions(cand.core, space):
        stages = cand.compressed_stages.get(method, cand.stages)
        yield cand.core.with_(**_compression_fields(method, space)), stages


def _outer_dtypes(geo: str, space: SearchSpace) -> list[str]:
    """DiLoCo's outer dtypes to try: as set (auto by default), and topk2 besides where the quality
    table accepts its measured loss (:func:`~isthmus.planner.compression.not_chosen`)."""
    setting = space.setting("outer_dtype")
    if space.pin("outer_dtype") is not None or geo not in DILOCO_SYNCS:
        return [setting]
    sparse = LayoutSpec(datacenters=2, dc_axis="dp", sync=geo, outer_dtype="topk2")
    sparse = sparse.with_(outer_density=space.setting("outer_density"))
    return [setting, "topk2"] if not_chosen(sparse) is None else [setting]


def _geos(core: LayoutSpec, space: SearchSpace) -> list[str]:
    return [g for g in space.sync if g in GEO_SYNCS] if core.dc_axis == "dp" else ["none"]


def _variants(
    cand: _Core,
    topo: Topology,
    placed: PlacementCache,
    runtime: Runtime,
    space: SearchSpace,
    heap: _Ranking,
    result: SearchResult,
    counter: int,
) -> int:
    """Evaluate the dp split / ZeRO / cross-datacenter variants of one core layout."""
    core, work = cand.core, cand.work
    p, per_dc = core.pp, core.dp_replicate  # the core has no dp_shard yet: its dp inside one datacenter
    fields = {f: getattr(core, f) for f in _CORE_FIELDS}
    for shard, ep in ((s, e) for s in cand.shards for e in _expert_choices(work.args, s, core.cp, space)):
        pl = None
        for zero in _zero_choices(core, shard, space):
            if ep > 1 and zero == 1:
                continue  # ZeRO-1 shards no expert-parallel weights: the runtime refuses it
            probe = LayoutSpec(**fields, dp_replicate=per_dc // shard, dp_shard=shard, zero_stage=zero, ep=ep)
            gathered = gathered_weight_bytes(runtime, work.dtype, probe.data_parallel_kind == "fsdp")
            state = moe_state_bytes(
                cand.first_params,
                cand.first_experts,
                ep,
                zero,
                probe.shard_degree,
                runtime,
                core.microbatches_per_step > 1,
                p,
                gathered,
            )
            if sum(state) + cand.first_act > cand.usable:
                result.considered += 1  # its variants are not enumerated: counted once, as refused
                result.over_memory(MemoryBreakdown(*state, cand.first_act, 0.0))
                continue
            pl = pl or placed(probe)
            # Time slots matter only where several transfers share a WAN link; they change no memory.
            schedules = _wan_schedules(core.dc_axis, space)
            if len(schedules) > 1 and max((n for _, n, wan in pl.boundary_links if wan), default=1) == 1:
                schedules = schedules[:1]
            fair_step: float | None = None
            fair_steps: dict[tuple[str, str, str], float] = {}
            # Memory depends on neither the strategy nor the WAN schedule: once one of them does not
            # fit, none does, and the rest are counted as refused without timing them.
            refused: MemoryBreakdown | None = None
            for geo, wan_schedule, method, outer in (
                (g, w, c, o)
                for g in _geos(core, space)
                for w in schedules
                for c in _compressions(core, space)
                for o in _outer_dtypes(g, space)
            ):
                if geo == "flat" and probe.shard_degree > 1:
                    continue  # with a shard group inside each datacenter, 'flat' is 'hierarchical'
                if geo != "none" and zero_stage(zero, shard, core.tp, core.pp, core.cp, core.replicas, True):
                    continue  # ZeRO-1 runs under no cross-datacenter strategy: the runtime refuses it
                if wan_schedule != schedules[0] and fair_step is None:
                    continue  # the fair variant did not fit
                if refused is not None:
                    result.considered += 1
                    result.over_memory(refused)
                    continue
                lay = LayoutSpec(
                    **fields,
                    dp_replicate=per_dc // shard,
                    dp_shard=shard,
                    zero_stage=zero,
                    ep=ep,
                    sync=geo,  # type: ignore[arg-type]
                    inner_steps=space.setting("inner_steps"),
                    fragments=space.setting("fragments"),
                    overlap_steps=space.setting("overlap_steps"),
                    wan_schedule=wan_schedule,  # type: ignore[arg-type]
                    wan_streams=space.setting("wan_streams"),
                    pp_early_recv=space.setting("pp_early_recv") and _posts_ahead(core, wan_schedule),
                    outer_dtype=outer,  # type: ignore[arg-type]
                    outer_density=space.setting("outer_density"),
                    **_compression_fields(method, space),
                )
                # Blocking sends (Megatron) put the WAN schedule into the stage costs.
                same = (runtime.p2p_async or wan_schedule == core.wan_schedule) and ep == core.ep
                stages = cand.compressed_stages.get(method, cand.stages)
                est = estimate(work, topo, lay, runtime, pl, stages if same else None)
                result.considered += 1
                if not est.fits:
                    result.over_memory(est.memory)
                    refused = est.memory
                    continue
                if wan_schedule == schedules[0]:
                    fair_step = fair_steps[(geo, method, outer)] = est.step_time_s
                elif est.step_time_s >= fair_steps.get((geo, method, outer), float("inf")):
                    continue
                counter += 1
                _remember(result, est)
                heap.offer((est.effective_tokens_per_s, -counter, est), runnable(topo, lay, pl))
    return counter


_CORE_FIELDS = (
    "tp",
    "sequence_parallel",
    "cp",
    "cp_impl",
    "pp",
    "pp_schedule",
    "pp_virtual_stages",
    "micro_batch",
    "microbatches",
    "grad_accum",
    "activation_checkpoint",
    "datacenters",
    "dc_axis",
)


_MATCHED = ("cp_impl", "microbatches", "grad_accum")
"""Core fields the search derives or takes every value of: a fixed one is matched on its cores."""


def _zero_choices(core: LayoutSpec, shard: int, space: SearchSpace) -> list[int]:
    """The ZeRO stages of ``isthmus.layout.rules.zero_stages`` (the runtime's rule) that the space allows."""
    stages = zero_stages(shard, core.tp, core.pp, core.cp, core.replicas // shard)
    return [z for z in stages if space.pin("zero_stage") in (None, z)]


def _remember(result: SearchResult, est: Estimate) -> None:
    """Keep ``est`` as the best of each family it belongs to."""
    lay = est.layout
    keys = [
        f"dc_axis={lay.dc_axis}",
        f"datacenters={lay.datacenters}",
        f"wan_schedule={lay.wan_schedule}",
        f"sync={lay.sync}",
        f"tp={lay.tp}",
        f"pp={'1' if lay.pp == 1 else '>1'}",
        f"activation_checkpoint={lay.activation_checkpoint}",
        f"pp_schedule={lay.pp_schedule}",
        f"cp={lay.cp}",
        f"zero={lay.zero_stage if lay.shard_degree > 1 else 0}",
        f"ep={lay.ep}",
        f"pp_compression={lay.pp_compression}",
    ]
    for key in keys:
        _keep(result, key, est)


def _keep(result: SearchResult, key: str, est: Estimate) -> None:
    old = result.alternatives.get(key)
    if old is None or est.effective_tokens_per_s > old.effective_tokens_per_s:
        result.alternatives[key] = est


def usable_bytes(topo: Topology) -> float:
    """What the plan may fill of the smallest device of ``topo``."""
    return min(dc.kind.memory_bytes for dc in topo.datacenters) * USABLE_FRACTION


def memory_parts(mem: MemoryBreakdown, usable: float) -> str:
    """One line: a device's memory by part against what may be filled."""
    parts = ("weights", "grads", "optimizer", "activations", "transient")
    body = " + ".join(f"{name} {getattr(mem, name) / 1e9:.1f}" for name in parts)
    return f"{body} = {mem.total / 1e9:.1f} GB of {usable / 1e9:.1f} GB usable"
