"""Search every valid layout of a workload on a topology, prune, and rank by throughput.

The space: datacenters used and which axis crosses them (dp or pp), tp (a divisor of the node that
divides the heads), cp, pp, the dp_replicate x dp_shard split and ZeRO stage, microbatch size and
count, pipeline schedule and virtual stages, recomputation, and the cross-datacenter strategy.
Pruning, in order: rules the runtime enforces (``pipeline.check_pipeline``, ZeRO-1 alone); a
memory floor before any timing; dominance (sequence parallelism whenever tp > 1: same bytes, less
memory, less redundant elementwise work; GPipe only where 1F1B cannot run); and branch and bound:
the dp/ZeRO/geo variants of a candidate are skipped when its pipeline phase alone is slower than
the current k-th best step.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace

from isthmus.errors import ConfigError
from isthmus.models.args import ModelArgs
from isthmus.models.flops import count_params
from isthmus.planner.cost import Estimate, estimate, rank_memory, stage_costs
from isthmus.planner.layout import GEO_STRATEGIES, Layout, Runtime, Workload
from isthmus.planner.memory import USABLE_FRACTION, model_state_bytes, stage_params
from isthmus.planner.pipeline import check_pipeline, pipeline_time
from isthmus.planner.placement import place
from isthmus.topology import Topology

DEFAULT_SEQ_LENS = (2048, 4096, 8192)
DEFAULT_BATCH_TOKENS = 4 * 1024 * 1024
MICRO_BATCHES = (1, 2, 4, 8, 16)
MIN_CP_TOKENS = 2048
"""Context parallelism only splits sequences into pieces of at least this many tokens."""


@dataclass(frozen=True)
class SearchSpace:
    """What the search may choose; a non-None field fixes that choice."""

    global_batch: int | None = None
    seq_len: int | None = None
    micro_batch: int | None = None
    recompute: str | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    dp_shard: int | None = None
    zero_stage: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    dc_axis: str | None = None
    """'none' (one datacenter), 'dp' or 'pp'."""
    geo: tuple[str, ...] = GEO_STRATEGIES
    diloco_h: int = 100
    max_batch_tokens: int = DEFAULT_BATCH_TOKENS
    """Tokens per step when global_batch is left to the search."""


@dataclass
class SearchResult:
    ranked: list[Estimate]
    """Best first, by effective tokens/s."""
    considered: int = 0
    pruned_memory: int = 0
    alternatives: dict[str, Estimate] = field(default_factory=dict)
    """Best layout per family ('dc_axis=pp', 'geo=diloco', 'tp=4', ...) for explanations."""

    @property
    def best(self) -> Estimate:
        return self.ranked[0]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _placements(topo: Topology, space: SearchSpace) -> list[tuple[int, str]]:
    n = len(topo.datacenters)
    opts = [(1, "none")] + ([(n, "dp"), (n, "pp")] if n > 1 else [])
    return [o for o in opts if space.dc_axis is None or o[1] == space.dc_axis]


def _schedules(space: SearchSpace, pp: int, m: int, layers: int, runtime: Runtime) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out: list[tuple[str, int]] = []
    for sched in ("1f1b", "interleaved_1f1b", "zero_bubble", "gpipe"):
        if space.schedule not in (None, sched):
            continue
        vs = [1] if sched in ("1f1b", "gpipe") else ([2] if sched == "zero_bubble" else [2, 3, 4, 8])
        for v in vs:
            if space.virtual_stages not in (None, v) or check_pipeline(sched, pp, m, v, layers, runtime.name):
                continue
            if sched == "gpipe" and space.schedule is None and any(s == "1f1b" for s, _ in out):
                continue  # same time as 1F1B, more memory
            out.append((sched, v))
    return out


def _fix(choices: list[int], fixed: int | None) -> list[int]:
    return [c for c in choices if fixed is None or c == fixed]


def search(args: ModelArgs, topo: Topology, space: SearchSpace, runtime: Runtime, top: int = 10, dtype: str = "bf16") -> SearchResult:
    """The ``top`` best layouts that fit in memory; ConfigError when none does."""
    if not _placements(topo, space):
        raise ConfigError("--dc-axis", space.dc_axis, f"topology {topo.name!r} has one datacenter; use none")
    seqs = [space.seq_len] if space.seq_len else list(DEFAULT_SEQ_LENS)
    heap: list[tuple[float, int, Estimate]] = []
    result = SearchResult([])
    counter = 0
    for seq in seqs:
        for dc, axis in _placements(topo, space):
            used = [topo.datacenters[i] for i in _used(topo, dc)]
            per_dc = min(d.devices for d in used)
            world = per_dc * dc
            node = min(d.devices_per_node for d in used)
            usable = min(d.kind.memory_bytes for d in used) * USABLE_FRACTION
            for tp in _fix([t for t in divisors(node) if args.n_heads % t == 0 and args.n_kv_heads % t == 0], space.tp):
                cps = [c for c in divisors(per_dc // tp) if seq % (2 * c) == 0 and (c == 1 or seq // c >= MIN_CP_TOKENS)]
                for cp in _fix(cps, space.cp):
                    for pp in _fix([p for p in divisors(world // (tp * cp)) if p <= args.n_layers], space.pp):
                        if axis == "pp" and (pp % dc or pp < dc):
                            continue
                        dp = world // (tp * cp * pp)
                        if axis == "dp" and dp % dc:
                            continue
                        for mb in _fix(list(MICRO_BATCHES), space.micro_batch):
                            m = _microbatches(space, seq, dp, mb, pp)
                            if m is None:
                                continue
                            work = Workload(args, dp * mb * m, seq, dtype)
                            for sched, v in _schedules(space, pp, m, args.n_layers, runtime):
                                for rc in [space.recompute] if space.recompute else ["none", "selective", "full"]:
                                    for impl in _cp_impls(args, tp, cp):
                                        core = Layout(tp=tp, sp=tp > 1 and seq % (tp * cp) == 0, cp=cp, cp_impl=impl, pp=pp, schedule=sched,  # type: ignore[arg-type]
                                                      virtual_stages=v, dp_replicate=dp, micro_batch=mb, microbatches=m,
                                                      recompute=rc, dc=dc, dc_axis=axis)  # type: ignore[arg-type]
                                        counter = _variants(work, topo, core, runtime, space, usable, heap, top, result, counter)
    if not heap:
        raise ConfigError("--topology", topo.name, f"no layout of this {count_params(args) / 1e9:.2f}B-parameter model fits "
                          f"in device memory ({result.considered} considered, {result.pruned_memory} over memory)")
    result.ranked = [est for _, _, est in sorted(heap, key=lambda x: (-x[0], x[1]))]
    return result


def _cp_impls(args: ModelArgs, tp: int, cp: int) -> list[str]:
    """Ring always; Ulysses when cp divides the heads of a tensor-parallel rank."""
    if cp == 1:
        return ["ring"]
    return ["ring", "ulysses"] if (args.n_heads // tp) % cp == 0 and (args.n_kv_heads // tp) % cp == 0 else ["ring"]


def _used(topo: Topology, dc: int) -> list[int]:
    from isthmus.planner.placement import choose_dcs

    return choose_dcs(topo, Layout(dc=dc))


def _microbatches(space: SearchSpace, seq: int, dp: int, mb: int, pp: int) -> int | None:
    if space.global_batch is not None:
        if space.global_batch % (dp * mb):
            return None
        return space.global_batch // (dp * mb)
    m = space.max_batch_tokens // (seq * dp * mb)
    if m < 1:
        return None
    return m // pp * pp if m >= pp else m


def _variants(work: Workload, topo: Topology, core: Layout, runtime: Runtime, space: SearchSpace, usable: float,
              heap: list[tuple[float, int, Estimate]], top: int, result: SearchResult, counter: int) -> int:
    """Evaluate the dp split / ZeRO / cross-datacenter variants of one core layout."""
    p, dp = core.pp, core.dp_replicate
    cut = core.dc if core.dc_axis == "dp" else 1
    geos = [g for g in space.geo if g in GEO_STRATEGIES] if core.dc_axis == "dp" else ["none"]
    # Memory floor: the first rank (most microbatches in flight) with at least its share of layers
    # less one; activations do not depend on the dp split, model state does, cheaply.
    layers = max(core.virtual_stages, work.args.n_layers // p - (1 if p > 1 else 0))
    first_params = stage_params(work.args, layers, True, p == 1, p) / core.tp
    first_mem = rank_memory(work, core, runtime, 0, layers)
    first_act = first_mem.activations + first_mem.transient
    stages = None
    fields = {f: getattr(core, f) for f in _CORE_FIELDS}
    for shard in _fix(divisors(dp // cut), space.dp_shard):
        pl = None
        for zero in _zero_choices(core, shard, space):
            probe = Layout(**fields, dp_replicate=dp // shard, dp_shard=shard, zero_stage=zero)
            result.considered += 1
            floor = sum(model_state_bytes(first_params, zero, probe.shard_degree, runtime, core.microbatches > 1, p)) + first_act
            if floor > usable:
                result.pruned_memory += 1
                continue
            pl = pl or place(topo, probe)
            if stages is None:
                stages = stage_costs(work, probe, runtime, pl)
                t_floor, _ = pipeline_time([s.total for s in stages], [s.wgrad for s in stages], core.microbatches,
                                           core.virtual_stages, core.schedule)
                best_q = max(runtime.quality_of(g) for g in geos)
                if len(heap) >= top and work.tokens_per_step / t_floor * best_q < heap[0][0]:
                    return counter  # even with free data parallelism this core cannot enter the top k
            for geo in geos:
                if geo == "flat" and probe.shard_degree > 1:
                    continue  # with a shard group inside each datacenter, 'flat' is 'hierarchical'
                lay = Layout(**fields, dp_replicate=dp // shard, dp_shard=shard, zero_stage=zero, geo=geo,  # type: ignore[arg-type]
                             diloco_h=space.diloco_h if geo == "diloco" else 0)
                est = estimate(work, topo, lay, runtime, pl, stages)
                if not est.fits:
                    result.pruned_memory += 1
                    continue
                counter += 1
                _remember(result, est)
                item = (est.effective_tokens_per_s, -counter, est)
                if len(heap) < top:
                    heapq.heappush(heap, item)
                elif item[0] > heap[0][0]:
                    heapq.heapreplace(heap, item)
    return counter


_CORE_FIELDS = ("tp", "sp", "cp", "cp_impl", "pp", "schedule", "virtual_stages", "micro_batch", "microbatches",
                "recompute", "dc", "dc_axis")


def _zero_choices(core: Layout, shard: int, space: SearchSpace) -> list[int]:
    probe = replace(core, dp_shard=shard)
    if probe.shard_degree <= 1:
        return [1] if space.zero_stage in (None, 1) else []
    # ZeRO-1 (DDP + a sharded optimizer) composes with dp_shard alone in isthmus.
    alone = core.tp == 1 and core.pp == 1 and core.cp == 1 and core.dp_replicate == shard
    zs = [1, 2, 3] if alone else [2, 3]
    return [z for z in zs if space.zero_stage in (None, z)]


def _remember(result: SearchResult, est: Estimate) -> None:
    lay = est.layout
    keys = [f"dc_axis={lay.dc_axis}", f"geo={lay.geo}", f"tp={lay.tp}", f"pp={'1' if lay.pp == 1 else '>1'}",
            f"recompute={lay.recompute}", f"schedule={lay.schedule}", f"cp={lay.cp}", f"zero={lay.zero_stage if lay.shard_degree > 1 else 0}"]
    for key in keys:
        old = result.alternatives.get(key)
        if old is None or est.effective_tokens_per_s > old.effective_tokens_per_s:
            result.alternatives[key] = est
