"""The cost of one layout: step time, throughput, MFU, memory, bubble and WAN traffic.

``estimate`` composes the pieces: per-op compute (compute.py) and tensor/context-parallel
collectives per block (:func:`block_cost`); the stage partition and per-microbatch cost of each
pipeline rank (:func:`stage_costs`); the pipeline schedule (pipeline.py); data-parallel
synchronisation and its overlap with backward (geo.py); memory per device (memory.py). The
simulator replays the same per-microbatch numbers event by event.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Protocol

from isthmus.errors import ConfigError
from isthmus.layout.spec import LayoutSpec
from isthmus.models.args import ModelArgs
from isthmus.models.flops import flops_per_token
from isthmus.planner import comm
from isthmus.planner.compression import boundary_message, codec_seconds, compressed
from isthmus.planner.compute import (
    FP8_RECIPES,
    OVERLAP_GEMM_SLOWDOWN,
    BlockShape,
    PhaseTimes,
    act_bytes,
    attention_core_fwd,
    ends_times,
    layer_ops,
    layer_times,
    optimizer_time,
    rank_imbalance,
    shard_overhead,
)
from isthmus.planner.geo import dp_sync, pipeline_transfer, streaming_exposed
from isthmus.planner.memory import (
    USABLE_FRACTION,
    MemoryBreakdown,
    alternate_share,
    device_memory,
    stage_expert_params,
    stage_params,
)
from isthmus.planner.pipeline import LinkStage, even_partition, in_flight, partition_layers, pipeline_time
from isthmus.planner.placement import Placement, SiteSpans, place
from isthmus.planner.topology import DeviceKind, Link, Topology
from isthmus.planner.workload import COMPILED, TRAINED_DTYPES, Runtime, Workload

RING_HIDDEN_SHARE = 0.3
"""Share of a block's forward that ring attention's KV hops can hide behind (its attention part)."""


@dataclass(frozen=True)
class BlockCost:
    """One block, one microbatch, one device: compute and the tp/cp communication on its critical path."""

    compute: PhaseTimes
    tp: float
    """Tensor-parallel collectives of one forward, as far as they are not hidden under GEMMs."""
    cp_fwd: float
    cp_bwd: float
    core_fwd: float = 0.0
    """The attention core's forward alone (what attention-core selective recomputation repeats)."""
    ep: float = 0.0
    """A MoE block's token dispatch and combine all-to-alls of one forward (the backward has as many)."""
    tp_back: float | None = None
    """The backward's exposed tensor-parallel collectives; None: as the forward's."""

    @property
    def tp_bwd(self) -> float:
        return self.tp if self.tp_back is None else self.tp_back

    @property
    def fwd(self) -> float:
        return self.compute.fwd + self.tp + self.cp_fwd + self.ep

    @property
    def bwd(self) -> float:
        return self.compute.backward + self.tp_bwd + self.cp_bwd + self.ep


def tp_span(site: SiteSpans, runtime: Runtime) -> comm.Span:
    """The tensor-parallel group's span, its links as its collectives take them (all-reduces, or with
    sequence parallelism all-gathers and reduce-scatters): through the node's shared memory where the
    runtime moves them there and the group stays in one node with that path."""
    host = site.dc.host_memory
    if host is not None and tp_on_host(site, runtime):
        return replace(site.tp, intra=host)
    return site.tp


def tp_on_host(site: SiteSpans, runtime: Runtime) -> bool:
    """Whether the tensor-parallel group's collectives go through the node's shared memory: the
    runtime moves them there and the group stays in one node that has that path."""
    return runtime.tp_host_memory and site.dc.host_memory is not None and site.tp.nodes == 1 and site.tp.dcs == 1


@lru_cache(maxsize=8192)
def block_cost(kind: DeviceKind, site: SiteSpans, block: BlockShape, cp_impl: str, runtime: Runtime) -> BlockCost:
    a, b, s, e = block.args, block.micro_batch, block.seq_len, act_bytes(block.dtype)
    tp, cp, sp = block.tp, block.cp, block.sp
    t = layer_times(kind, block, runtime)
    act = b * s / cp * a.dim * e
    tp_fwd, tp_bwd = tp_collectives(kind, site, block, runtime, act)
    if tp > 1:  # measured runtime work of a tensor-parallel block and pass (0 unless a profile says)
        work = kind.tp_block_s + (kind.sp_block_s if sp else 0.0)
        tp_fwd, tp_bwd = tp_fwd + work, tp_bwd + work
    cp_f = cp_b = 0.0
    if cp > 1:
        kv = b * s / cp * 2 * a.n_kv_heads * a.head_dim / tp * e
        if cp_impl == "ring":
            hop = comm.p2p(kv, site.cp.intra if site.cp.nodes == 1 else site.cp.fabric)
            hidden = RING_HIDDEN_SHARE * t.fwd
            cp_f = max(0.0, (cp - 1) * hop - hidden)
            cp_b = max(0.0, 2 * (cp - 1) * hop - 2 * hidden)  # K, V forward; dK, dV back
        else:
            q = b * s / cp * a.n_heads * a.head_dim / tp * e
            cp_f = cp_b = comm.all_to_all(q + kv, site.cp) + comm.all_to_all(q, site.cp)
    core = attention_core_fwd(kind, block, runtime)
    return BlockCost(t, tp_fwd, cp_f, cp_b, core, expert_all_to_all(site, block, runtime), tp_bwd)


def tp_collectives(
    kind: DeviceKind, site: SiteSpans, block: BlockShape, runtime: Runtime, act: float
) -> tuple[float, float]:
    """Seconds of one block's tensor-parallel collectives left exposed in its forward and its backward.

    Each half of a block (attention, MLP) exchanges its hidden states twice each way: an all-gather
    into its first GEMM and a reduce-scatter out of its last (an all-reduce each without sequence
    parallelism: the same bytes). Under FP8 the gathers carry the quantised tensor where the recipe's
    scales survive a gather. ``Runtime.tp_overlap`` says how much hides (only with sequence
    parallelism, which both Megatron's and torch's overlap need): bulk hides the backward's
    collectives under the independent weight-gradient GEMM of the same layer; pipelined splits every
    collective into tp chunks that stream under the GEMM consuming or producing them, one chunk left
    exposed. An overlapped GEMM is slowed by :data:`OVERLAP_GEMM_SLOWDOWN`.
    """
    if block.tp <= 1:
        return 0.0, 0.0
    a, span = block.args, tp_span(site, runtime)
    gathered = act
    if block.dtype == "fp8" and FP8_RECIPES[runtime.fp8_recipe].gathers_fp8:
        gathered = act / act_bytes(block.dtype)
    copies = 1.0
    if a.is_moe:
        # Experts split over tp gather every routed copy their tp group received (and reduce-scatter
        # the results back): the MoE half's collectives carry top_k copies per token at the busiest
        # rank's load, not one hidden state (Megatron-Core's all-to-all dispatcher with expert tp = tp).
        copies = a.top_k * rank_imbalance(block, runtime)
    # (collective seconds, the GEMM it meets) per exchange, in block order; that GEMM's backward
    # passes are its ".dgrad" and ".wgrad" ops.
    mlp_in, mlp_out = ("experts.fc1", "experts.fc2") if a.is_moe else ("fc1", "fc2")
    pairs = [
        (comm.all_gather(gathered, span), "qkv"),
        (comm.reduce_scatter(act, span), "proj"),
        (comm.all_gather(gathered * copies, span), mlp_in),
        (comm.reduce_scatter(act * copies, span), mlp_out),
    ]
    exposed = sum(c for c, _ in pairs)
    if runtime.tp_overlap == "none" or not block.sp:
        return exposed, exposed
    ops = {op.name: op.seconds for op in layer_ops(kind, block, runtime)}
    slow = OVERLAP_GEMM_SLOWDOWN
    if runtime.tp_overlap == "bulk":
        bwd = sum(max(0.0, c - ops.get(g + ".wgrad", 0.0)) + slow * ops.get(g + ".wgrad", 0.0) for c, g in pairs)
        return exposed, bwd
    chunks = block.tp
    fwd = sum(max(c / chunks, c - ops.get(g, 0.0)) + slow * ops.get(g, 0.0) for c, g in pairs)
    bwd = sum(max(c / chunks, c - ops.get(g + ".dgrad", 0.0)) + slow * ops.get(g + ".dgrad", 0.0) for c, g in pairs)
    return fwd, bwd


def expert_all_to_all(site: SiteSpans, block: BlockShape, runtime: Runtime) -> float:
    """Seconds of one MoE block's forward all-to-alls over its ep group: dispatch sends each token's
    top_k copies (tokens x top_k x dim elements per rank; each tp rank its sequence shard under sequence
    parallelism) to the ranks holding their experts, combine brings them back. The busiest rank
    receives :func:`rank_imbalance` times its share. Priced on the links the group spans: NVLink inside
    a node, the fabric across nodes; an ep group never spans datacenters (``rules.expert_parallel``),
    but a span over the WAN would be priced on it."""
    if site.ep is None or block.ep <= 1:
        return 0.0
    a = block.args
    tokens = block.micro_batch * block.seq_len / block.cp / (block.tp if block.sp else 1)
    nbytes = tokens * a.top_k * a.dim * act_bytes(block.dtype) * rank_imbalance(block, runtime)
    return 2 * comm.all_to_all(nbytes, site.ep)


def _share(part: float, other: float) -> float:
    """``part``'s share of ``part + other`` (0 when both are 0)."""
    return part / (part + other) if part + other > 0 else 0.0


@dataclass(frozen=True)
class StageCost:
    """Pipeline rank r, one microbatch through all its virtual stages, on its slowest datacenter."""

    layers: int
    fwd: float
    bwd: float
    """Backward including recomputation."""
    wgrad: float
    parts: tuple[tuple[str, float], ...]
    """fwd + bwd split by cause: compute, tp comm, cp comm, pp p2p (blocking sends only)."""

    @property
    def total(self) -> float:
        return self.fwd + self.bwd


def recompute_share(recompute: str, runtime: Runtime | None = None) -> float:
    """Blocks whose forward runs twice: all (full), every other one (isthmus 'selective'), none;
    0 for a runtime whose 'selective' repeats only the attention core (see :func:`recomputed`)."""
    if recompute == "selective" and runtime is not None and runtime.selective == "attention_core":
        return 0.0
    return {"full": 1.0, "selective": 0.5}.get(recompute, 0.0)


def recomputed(
    bc: BlockCost, recompute: str, runtime: Runtime, layers: int = 0, virtual_stages: int = 1
) -> tuple[float, float, float]:
    """(compute, tp, cp) seconds one block's backward repeats of its forward, per microbatch, on
    average over a rank's ``layers`` blocks in ``virtual_stages`` modules: whole forwards (full, or
    every other block of each module), or the attention core alone (no collective: sequence
    parallelism gathered its input already)."""
    if recompute == "selective" and runtime.selective == "attention_core":
        return bc.core_fwd, 0.0, 0.0
    rc = alternate_share(layers, virtual_stages) if recompute == "selective" else recompute_share(recompute)
    # A recomputed MoE block dispatches and combines its tokens again: its all-to-alls count with cp's.
    return rc * bc.compute.fwd, rc * bc.tp, rc * (bc.cp_fwd + bc.ep)


def recompute_flops_per_token(args: ModelArgs, seq_len: int, recompute: str, runtime: Runtime) -> float:
    """FLOPs per token the backward repeats (hardware FLOPs minus model FLOPs)."""
    if recompute == "selective" and runtime.selective == "attention_core":
        # QK^T and scores x V over the whole square, as Megatron counts them (Korthikanti et al. Eq. 8).
        return 4.0 * seq_len * args.n_heads * args.head_dim * args.n_layers
    model = flops_per_token(args, seq_len, False)
    return recompute_share(recompute) * (flops_per_token(args, seq_len, True) - model)


def _ends(
    kind: DeviceKind, work: Workload, layout: LayoutSpec, r: int, runtime: Runtime
) -> tuple[PhaseTimes, PhaseTimes]:
    emb, head = ends_times(kind, BlockShape.of(work, layout), runtime.fused_cross_entropy)
    zero = PhaseTimes(0.0, 0.0, 0.0, 0.0)
    return (emb if r == 0 else zero), (head if r == layout.pp - 1 else zero)


def stage_costs(work: Workload, layout: LayoutSpec, runtime: Runtime, pl: Placement) -> list[StageCost]:
    """Per pipeline rank: layers (Megatron: even split; isthmus: balanced by speed) and microbatch cost."""
    p, v, e = layout.pp, layout.pp_virtual_stages, act_bytes(work.dtype)
    block = BlockShape.of(work, layout)
    per_site = [(site, block_cost(site.dc.kind, site, block, layout.cp_impl, runtime)) for site in pl.sites]
    blocks = [[per_site[i] for i in pl.stage_sites[r]] for r in range(p)]
    if runtime.megatron_stages or p == 1:
        layers = even_partition(work.args.n_layers, p)
    else:
        per_sites = {
            sites: max(
                per_site[i][1].fwd
                + per_site[i][1].bwd
                + sum(recomputed(per_site[i][1], layout.activation_checkpoint, runtime))
                for i in sites
            )
            for sites in set(pl.stage_sites)
        }
        per_layer = [per_sites[sites] for sites in pl.stage_sites]
        extra = [0.0] * p
        for r in (0, p - 1):
            extra[r] = max(
                sum(x.fwd + x.backward for x in _ends(site.dc.kind, work, layout, r, runtime)) for site, _ in blocks[r]
            )
        layers = partition_layers(work.args.n_layers, per_layer, extra, min_layers=v)
    act = layout.micro_batch * work.seq_len / layout.cp * work.args.dim * e
    msg = act / (layout.tp if runtime.scatter_gather or layout.sequence_parallel else 1)
    wan_msg = boundary_message(work, layout, runtime, wan=True)
    memo: dict[tuple[object, ...], StageCost] = {}
    out = []
    for r in range(p):
        near = tuple(pl.boundary_links[j] for j in (r - 1, r) if 0 <= j < p - 1)
        key = (layers[r], r == 0, r == p - 1, pl.stage_sites[r], near)
        if key not in memo:  # interior ranks of a uniform pipeline are all alike
            memo[key] = _stage_cost(work, layout, runtime, blocks[r], layers[r], r, near, act, msg, wan_msg)
        out.append(memo[key])
    return out


def _stage_cost(
    work: Workload,
    layout: LayoutSpec,
    runtime: Runtime,
    row: list[tuple[SiteSpans, BlockCost]],
    n: int,
    r: int,
    near: tuple[tuple[Link, int, bool], ...],
    act: float,
    msg: float,
    wan_msg: float,
) -> StageCost:
    v = layout.pp_virtual_stages
    worst: StageCost | None = None
    for site, bc in row:
        emb, head = _ends(site.dc.kind, work, layout, r, runtime)
        p2p = 0.0
        if layout.pp > 1 and not runtime.p2p_async:  # blocking send/recv to each neighbour, per virtual stage
            gather = comm.all_gather(act, site.tp) if runtime.scatter_gather else 0.0
            p2p = sum(
                v
                * (
                    pipeline_transfer(
                        wan_msg if wan else msg,
                        link,
                        share,
                        layout.wan_schedule if wan else "fair",
                        layout.wan_streams,
                        wan and layout.pp_early_recv,
                    ).seconds
                    + gather
                )
                for link, share, wan in near
            )
            if runtime.p2p_rendezvous:  # the receives hold this rank as long as the sends do
                p2p *= 2
        r_compute, r_tp, r_cp = recomputed(bc, layout.activation_checkpoint, runtime, n, v)
        compute = (
            n * (bc.compute.fwd + r_compute + bc.compute.backward) + emb.fwd + emb.backward + head.fwd + head.backward
        )
        # Compressed boundaries between datacenters: this end's half of encoding and decoding the
        # activation it sends or receives (forward) and of its gradient (backward), per virtual stage.
        codec = v * sum(1 for _, _, wan in near if wan) * codec_seconds(site.dc.kind, work, layout, runtime)
        parts = (
            ("compute", compute),
            ("tp comm", n * (bc.tp + bc.tp_bwd + r_tp)),
            ("cp comm", n * (bc.cp_fwd + r_cp * _share(bc.cp_fwd, bc.ep) + bc.cp_bwd)),
            ("ep comm", 2 * n * bc.ep + n * r_cp * _share(bc.ep, bc.cp_fwd)),
            ("pp p2p", p2p),
        ) + ((("compression", 2 * codec),) if codec > 0 else ())
        cost = StageCost(
            layers=n,
            fwd=n * bc.fwd + emb.fwd + head.fwd + p2p / 2 + codec,
            bwd=n * (bc.bwd + r_compute + r_tp + r_cp) + emb.backward + head.backward + p2p / 2 + codec,
            wgrad=n * bc.compute.wgrad + head.wgrad,
            parts=parts,
        )
        if worst is None or cost.total > worst.total:
            worst = cost
    assert worst is not None
    return worst


@dataclass(frozen=True)
class RankSync:
    """Data-parallel cost of one pipeline rank at the end of a step, after overlap."""

    tail: float
    """Seconds after the pipeline phase: exposed gradient sync, weight gathers, optimizer."""
    dp: float
    wan: float
    optimizer: float
    per_microbatch: float
    """ZeRO-3 gathers per microbatch (overlap that microbatch's compute when the runtime overlaps)."""
    wan_bytes: float
    fragment: float = 0.0
    """streaming_diloco: WAN seconds of one fragment's exchange, overlapped with the next steps."""
    ports: float = 0.0
    """Seconds its gradient reductions and once-per-step gathers keep the device's own links busy
    (WAN legs aside), however they overlap compute."""


def rank_sync(work: Workload, layout: LayoutSpec, runtime: Runtime, pl: Placement, r: int, st: StageCost) -> RankSync:
    params = stage_params(work.args, st.layers, r == 0, r == layout.pp - 1, layout.pp) / layout.tp
    if work.args.is_moe and layout.ep > 1:
        # A rank holds 1/ep of the routed experts; their gradients go over the replicas of those experts
        # (dp_shard x cp x dp_replicate / ep), priced here on the dense part's group: an upper bound.
        params -= (1 - 1 / layout.ep) * stage_expert_params(work.args, st.layers) / layout.tp
    worst: RankSync | None = None
    for i in pl.stage_sites[r]:
        site = pl.sites[i]
        sc = dp_sync(params, site, layout, runtime)
        # Gradients of rank r are final r backward-chunks before rank 0's; the sync overlaps that.
        window = (st.bwd + r * st.bwd / layout.pp_virtual_stages) if runtime.dp_overlap else 0.0
        outer = sc.wan if layout.sync == "diloco" else 0.0  # DiLoCo's outer sync blocks, every H steps
        grad = max(0.0, sc.grad - outer - window) + outer
        params_exposed = max(0.0, sc.params - st.fwd) if runtime.gathers_overlap else sc.params
        opt = optimizer_time(site.dc.kind, params / max(1, layout.shard_degree)) + shard_overhead(
            site.dc.kind, layout, st.layers
        )
        wan = min(grad, sc.wan)
        cost = RankSync(
            grad + params_exposed + opt,
            grad + params_exposed - wan,
            wan,
            opt,
            sc.per_microbatch,
            sc.wan_bytes,
            sc.fragment,
            max(0.0, sc.grad - sc.wan) + sc.params,
        )
        if worst is None or cost.tail > worst.tail:
            worst = cost
    assert worst is not None
    return worst


def ranks_tp_on_host(pl: Placement, runtime: Runtime, r: int) -> bool:
    """Whether pipeline rank ``r``'s tensor-parallel collectives go through shared memory in every
    datacenter that runs it."""
    return all(tp_on_host(pl.sites[i], runtime) for i in pl.stage_sites[r])


def rank_memory(
    work: Workload,
    layout: LayoutSpec,
    runtime: Runtime,
    r: int,
    layers: int,
    fsdp: bool | None = None,
    tp_shared_file: bool = False,
) -> MemoryBreakdown:
    """Rank ``r``'s peak memory holding ``layers`` blocks; ``fsdp`` overrides whether FSDP2 holds
    the weights (default: the layout's data-parallel kind); ``tp_shared_file``: its tensor-parallel
    group exchanges through the host's shared memory (:func:`tp_on_host`)."""
    return device_memory(
        BlockShape.of(work, layout),
        runtime,
        layers=layers,
        first=r == 0,
        last=r == layout.pp - 1,
        pp=layout.pp,
        activation_checkpoint=layout.activation_checkpoint,
        in_flight=in_flight(layout.pp_schedule, layout.pp, layout.pp_virtual_stages, layout.microbatches, r),
        zero_stage=layout.zero_stage,
        shard=layout.shard_degree,
        accumulate=layout.microbatches_per_step > 1,
        microbatches=layout.microbatches,
        virtual_stages=layout.pp_virtual_stages,
        fsdp=layout.data_parallel_kind == "fsdp" if fsdp is None else fsdp,
        tp_shared_file=tp_shared_file,
    )


LOOP_TOKENS = {"1f1b": 2, "interleaved_1f1b": 3, "zero_bubble": 2, "zbv": 3}
"""Microbatch passes in flight around one pipeline boundary in steady state, per schedule as the
runtime orders its actions (:mod:`isthmus.sim.schedule`): one more than the difference between two
neighbours' warm-up forwards (1F1B: p - r; interleaved: 2 per rank; zero bubble: 1, ZB-V 2). GPipe
runs every forward before any backward: no loop."""


def pipeline_links(
    work: Workload, layout: LayoutSpec, runtime: Runtime, pl: Placement, busy: list[float]
) -> list[LinkStage]:
    """Pipeline boundaries as stages of their own, when sends overlap compute (``busy``: seconds per
    microbatch of each rank)."""
    p, v = layout.pp, layout.pp_virtual_stages
    if p == 1 or not runtime.p2p_async:
        return []
    xfers = [
        pipeline_transfer(
            boundary_message(work, layout, runtime, wan),
            link,
            share,
            layout.wan_schedule if wan else "fair",
            layout.wan_streams,
            wan and layout.pp_early_recv,
        )
        for link, share, wan in pl.boundary_links
    ]
    # Time slots start the pipelines one slot apart, and the same offsets serve every boundary:
    # the last pipeline ends the widest boundary's stagger after the first, once per step.
    stagger = max(x.stagger for x in xfers)
    tokens = LOOP_TOKENS.get(layout.pp_schedule if layout.pp_schedule != "zero_bubble" or v > 2 else "zbv")
    links = []
    for r, xfer in enumerate(xfers):
        one = xfer.seconds
        # A boundary paces the pipeline by its busy time, or by its loop: rank r + 1's backward of a
        # virtual stage, its message back, rank r's backward and next forward, the message over, rank
        # r + 1's forward. Only the microbatches rank r keeps in flight beyond rank r + 1's travel that
        # loop (LOOP_TOKENS), so they, not all of rank r's, hide the boundary's round trip.
        loop = (2 * v * one + busy[r] + busy[r + 1]) / tokens if tokens else 0.0
        links.append(LinkStage(max(v * xfer.occupancy, loop), 2 * one, 2 * v * one))
    if stagger > 0:
        links.append(LinkStage(0.0, stagger))
    return links


def bottleneck_of(breakdown: dict[str, float], step_time_s: float) -> str:
    """The largest cost after compute, or 'compute' when every other cost is under 5% of the step."""
    name = max((k for k in breakdown if k != "compute"), key=lambda k: breakdown[k])
    return name if breakdown[name] > 0.05 * step_time_s else "compute"


class Figures(Protocol):
    """What `isthmus plan --json` prints of a layout: the cost model's `Estimate` and the simulator's result alike."""

    @property
    def layout(self) -> LayoutSpec: ...
    @property
    def work(self) -> Workload: ...
    @property
    def runtime(self) -> str: ...
    @property
    def step_time_s(self) -> float: ...
    @property
    def tokens_per_s(self) -> float: ...
    @property
    def effective_tokens_per_s(self) -> float: ...
    @property
    def tflops_per_device(self) -> float: ...
    @property
    def mfu(self) -> float: ...
    @property
    def mem_per_device_gb(self) -> float: ...
    @property
    def fits(self) -> bool: ...
    @property
    def bubble_fraction(self) -> float: ...
    @property
    def wan_bytes_per_step(self) -> float: ...
    @property
    def breakdown(self) -> dict[str, float]: ...
    @property
    def stage_layers(self) -> tuple[int, ...]: ...
    @property
    def bottleneck(self) -> str: ...


def _config_sections(r: Figures) -> dict[str, dict[str, object]]:
    """The config keys that run the layout as planned: the layout's own, the precision when isthmus
    trains in it (fp32, bf16; the published runs' fp16 and fp8 are priced only) and compilation."""
    out = r.layout.config_sections(r.work.seq_len, r.work.args.tie_embeddings)
    if r.work.dtype in TRAINED_DTYPES:
        out["train"]["dtype"] = r.work.dtype
    out["train"]["compile"] = r.runtime.endswith(COMPILED)
    return out


def figures_json(r: Figures) -> dict[str, object]:
    """The JSON fields of one layout's figures, in the order `isthmus plan --json` prints them."""
    return {
        "layout": r.layout.as_dict(),
        "label": r.layout.label(),
        **_config_sections(r),
        "batch_size": r.work.batch_size,
        "seq_len": r.work.seq_len,
        "runtime": r.runtime,
        "step_time_s": r.step_time_s,
        "tokens_per_s": r.tokens_per_s,
        "effective_tokens_per_s": r.effective_tokens_per_s,
        "tflops_per_device": r.tflops_per_device,
        "mfu": r.mfu,
        "mem_per_device_gb": r.mem_per_device_gb,
        "fits": r.fits,
        "bubble_fraction": r.bubble_fraction,
        "wan_bytes_per_step": r.wan_bytes_per_step,
        "bottleneck": r.bottleneck,
        "breakdown_s": r.breakdown,
        "stage_layers": list(r.stage_layers),
    }


@dataclass(frozen=True)
class Estimate:
    layout: LayoutSpec
    work: Workload
    runtime: str
    step_time_s: float
    tokens_per_s: float
    effective_tokens_per_s: float
    """Tokens/s times the assumed quality factor of a lossy cross-datacenter strategy (ranking key)."""
    tflops_per_device: float
    """Achieved FLOP/s per device counting recomputation, as Megatron-LM reports it."""
    mfu: float
    """Model FLOPs (no recomputation) per second over the devices' peak."""
    mem_per_device_gb: float
    memory: MemoryBreakdown
    fits: bool
    bubble_fraction: float
    wan_bytes_per_step: float
    breakdown: dict[str, float] = field(default_factory=dict)
    """Seconds of the step by cause, on the slowest pipeline rank."""
    stages: tuple[StageCost, ...] = ()

    @property
    def stage_layers(self) -> tuple[int, ...]:
        return tuple(s.layers for s in self.stages)

    @property
    def bottleneck(self) -> str:
        """The largest cost after compute, or 'compute' when every other cost is under 5% of the step."""
        return bottleneck_of(self.breakdown, self.step_time_s)

    def as_json(self) -> dict[str, object]:
        return figures_json(self)


def estimate(
    work: Workload,
    topo: Topology,
    layout: LayoutSpec,
    runtime: Runtime,
    placement: Placement | None = None,
    stages: list[StageCost] | None = None,
) -> Estimate:
    """Everything the planner ranks by, for one layout (memory may exceed the device: see ``fits``).

    ``placement`` and ``stages`` may be passed in when already known: the stage costs depend on the
    layout only through tp, cp, pp, schedule, microbatching and recomputation, not on how data
    parallelism is split, so the search computes them once for all its dp_shard / zero / geo variants.
    """
    if layout.pp > 1 and layout.grad_accum > 1:
        raise ConfigError(
            "train.grad_accum",
            layout.grad_accum,
            "the cost model takes a pipeline's microbatches or gradient accumulation, not both (parallel.pp > 1)",
        )
    a, m, p, v = work.args, layout.microbatches_per_step, layout.pp, layout.pp_virtual_stages
    pl = placement or place(topo, layout)
    stages = stages or stage_costs(work, layout, runtime, pl)
    # Ranks with the same stage cost and sites differ only in r, and both the exposed sync and the
    # activations in flight shrink with r: the first rank of each class is its worst.
    first_of: dict[tuple[object, ...], int] = {}
    for r, st in enumerate(stages):
        first_of.setdefault((id(st), pl.stage_sites[r]), r)
    reps = {key: (r, rank_sync(work, layout, runtime, pl, r, stages[r])) for key, r in first_of.items()}
    syncs = [reps[(id(st), pl.stage_sites[r])][1] for r, st in enumerate(stages)]
    memory = max(
        (
            rank_memory(work, layout, runtime, r, stages[r].layers, tp_shared_file=ranks_tp_on_host(pl, runtime, r))
            for r, _ in reps.values()
        ),
        key=lambda mb: mb.total,
    )
    # A microbatch's ZeRO-3 gathers overlap the pass that needs them, when the runtime overlaps them:
    # the forward (with a pipeline, the weights stay gathered for the backward), or each half its pass.
    back = 0.5 if layout.pp == 1 else 0.0
    busy = [
        max(st.fwd, (1 - back) * sy.per_microbatch) + max(st.bwd, back * sy.per_microbatch)
        if runtime.gathers_overlap
        else st.total + sy.per_microbatch
        for st, sy in zip(stages, syncs)
    ]
    e = act_bytes(work.dtype)
    links = pipeline_links(work, layout, runtime, pl, busy)
    t_pipe, idle = pipeline_time(busy, [st.wgrad for st in stages], m, v, layout.pp_schedule, links)
    slow = max(range(p), key=lambda r: syncs[r].tail)
    step = t_pipe + syncs[slow].tail
    # Gathers and gradient reductions overlap compute, but not each other: they share the device's
    # links, so a step lasts at least all of them and the optimizer after the last reduction.
    ports = max(m * sy.per_microbatch + sy.ports + sy.optimizer for sy in syncs)
    shared = max(0.0, ports - step)
    step += shared
    # Streaming DiLoCo: the slowest fragment transfer against the steps it overlaps.
    streaming = streaming_exposed(max(sy.fragment for sy in syncs), step, layout)
    step += streaming
    # Activations and their gradients cross each WAN boundary once per sequence and virtual stage
    # (ZB-V's V and interleaving's chain pass each boundary v times); interleaving also wraps from
    # the last rank back to the first v - 1 times, across the WAN when they are in two datacenters.
    wan_cuts = sum(1 for _, _, wan in pl.boundary_links if wan) * v
    if layout.pp_schedule == "interleaved_1f1b" and pl.stage_sites[0] != pl.stage_sites[-1]:
        wan_cuts += v - 1
    if compressed(layout):
        # Every device of a pipeline rank (dp x cp x tp) sends its own message per microbatch.
        senders = layout.dp * layout.cp * layout.tp * m
        boundary_bytes = senders * boundary_message(work, layout, runtime, wan=True)
    else:
        boundary_bytes = (
            work.tokens_per_step * a.dim * e * (1 if runtime.scatter_gather or layout.sequence_parallel else layout.tp)
        )
    wan_bytes = sum(sy.wan_bytes for sy in syncs) + wan_cuts * 2 * boundary_bytes
    heavy = max(range(p), key=lambda r: busy[r])
    breakdown = {k: m * val for k, val in stages[heavy].parts}
    # What the WAN boundaries add to the pipeline phase (their pacing, latency and slots) is WAN time,
    # not bubble: the phase without them (the simulator measures it the same way).
    inside = [l for l, (_, _, w) in zip(links, pl.boundary_links) if not w]
    t_inside, _ = pipeline_time(busy, [st.wgrad for st in stages], m, v, layout.pp_schedule, inside)
    wan_wait = min(max(0.0, idle), max(0.0, t_pipe - t_inside))
    breakdown.update(
        {
            "dp comm": syncs[slow].dp + m * (busy[heavy] - stages[heavy].total) + shared,
            "wan": syncs[slow].wan + wan_wait + streaming,
            "bubble": max(0.0, idle - wan_wait),
            "optimizer": syncs[slow].optimizer,
        }
    )
    tokens_per_s = work.tokens_per_step / step
    model_flops = flops_per_token(a, work.seq_len, False)
    hw_flops = model_flops + recompute_flops_per_token(a, work.seq_len, layout.activation_checkpoint, runtime)
    kinds = [s.dc.kind for s in pl.sites]
    peak = sum(k.peak(work.dtype) for k in kinds) / len(kinds) * layout.world
    usable = min(k.memory_bytes for k in kinds) * USABLE_FRACTION
    return Estimate(
        layout=layout,
        work=work,
        runtime=runtime.name,
        step_time_s=step,
        tokens_per_s=tokens_per_s,
        effective_tokens_per_s=tokens_per_s * runtime.quality_of(layout.sync),
        tflops_per_device=hw_flops * tokens_per_s / layout.world / 1e12,
        mfu=model_flops * tokens_per_s / peak,
        mem_per_device_gb=memory.total / 1e9,
        memory=memory,
        fits=memory.total <= usable,
        # One bubble figure everywhere (table, JSON, explanation): the pipeline phase's idle time of
        # the busiest rank less what it spends waiting on WAN links, which the breakdown counts as wan.
        bubble_fraction=breakdown["bubble"] / step,
        wan_bytes_per_step=wan_bytes,
        breakdown=breakdown,
        stages=tuple(stages),
    )
