"""What the simulator replays: per-op compute from the planner, collectives as phases on link tiers.

The numbers are the planner's own (``compute.layer_ops``, ``cost.block_cost``, ``compute.ends_times``,
``comm`` and ``geo`` formulas), cut finer: a pipeline stage's forward, backward and weight-gradient
passes of one microbatch become ops with a timeline inside (each block's compute split at its two
tensor-parallel collectives), and every data-parallel collective becomes a chain of phases, one per
link tier it crosses, so the simulator can put each phase on the link that carries it. The phases
of a collective sum to exactly the planner's time for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from isthmus.layout.spec import LayoutSpec
from isthmus.planner import comm
from isthmus.planner.comm import Span
from isthmus.planner.compression import outer_equivalent
from isthmus.planner.compute import BlockShape, PhaseTimes, act_bytes, ends_times, layer_ops
from isthmus.planner.cost import BlockCost, block_cost
from isthmus.planner.geo import _inside, streaming_equivalent
from isthmus.planner.memory import held_layer_params
from isthmus.planner.placement import SiteSpans
from isthmus.planner.topology import DeviceKind
from isthmus.planner.workload import Runtime, Workload

Detail = tuple[float, float, str, str]
"""(offset from the op's start, seconds, name, category) of one interval inside an op."""


@dataclass(frozen=True)
class PhaseSpec:
    """One leg of a collective, before it is put on a link."""

    tier: str
    """'intra', 'fabric' or 'wan'."""
    latency: float
    seconds: float
    """Bytes time at the tier's per-member bandwidth (the planner's)."""
    bandwidth: float
    """That per-member bandwidth, bytes/s."""


@dataclass
class Op:
    """One pass of one microbatch through one stage on one device."""

    seconds: float
    detail: list[Detail]
    bucket_ends: list[tuple[float, float]] = field(default_factory=list)
    """(offset, parameters) where a gradient bucket becomes final, in order (backward passes only)."""


@dataclass
class StageOps:
    """The ops of one pipeline stage (one chunk of one rank) for one microbatch."""

    stage: int
    layers: int
    first: bool
    last: bool
    fwd: Op
    full_bwd: Op
    """Recomputation, input and weight gradients (1F1B, GPipe, interleaved)."""
    input_bwd: Op
    """Recomputation and input gradients only (zero bubble's I)."""
    weight_bwd: Op
    """Weight gradients only (zero bubble's W)."""
    params: float
    """Parameters of this stage on one device (after tensor parallelism)."""


def _split(kind: DeviceKind, work: Workload, layout: LayoutSpec, runtime: Runtime) -> dict[str, tuple[float, float]]:
    """Per phase, the block's compute before and after its first tensor-parallel collective.

    The attention half (norm, QKV, attention, output projection) ends in one all-reduce
    (all-gather + reduce-scatter with sp), the MLP half (residual, norm, MLP, residual) in the other.
    """
    ops = layer_ops(kind, BlockShape.of(work, layout), runtime)
    out = {"fwd": [0.0, 0.0], "bwd": [0.0, 0.0], "wgrad": [0.0, 0.0]}
    half = 0
    for op in ops:
        if op.name.startswith("residual1"):
            half = 1
        out[op.phase][half] += op.seconds
    return {k: (a, b) for k, (a, b) in out.items()}


def stage_ops(
    kind: DeviceKind,
    site: SiteSpans,
    work: Workload,
    layout: LayoutSpec,
    runtime: Runtime,
    stage: int,
    layers: int,
    first: bool,
    last: bool,
) -> StageOps:
    """The forward / backward / weight ops of one stage holding ``layers`` blocks."""
    bc: BlockCost = block_cost(kind, site, BlockShape.of(work, layout), layout.cp_impl, runtime)
    split = _split(kind, work, layout, runtime)
    emb, head = ends_times(kind, BlockShape.of(work, layout), runtime.fused_cross_entropy)
    zero = PhaseTimes(0.0, 0.0, 0.0, 0.0)
    emb, head = (emb if first else zero), (head if last else zero)
    ar, ar_bwd = bc.tp / 2, bc.tp_bwd / 2
    # Recomputation as the runtime applies it: every block (full) or every other block of a stage
    # module, counting from its first (selective), or every block's attention core alone
    # (selective where the runtime recomputes the attention core).
    core_only = layout.activation_checkpoint == "selective" and runtime.selective == "attention_core"
    recomputed = [
        layout.activation_checkpoint == "full"
        or (layout.activation_checkpoint == "selective" and not core_only and i % 2 == 0)
        for i in range(layers)
    ]
    a = work.args
    # A MoE rank holds (and reduces the gradients of) 1/ep of the routed experts.
    per_layer = (held_layer_params(a, layout.ep if a.is_moe else 1) + 2 * a.dim) / layout.tp
    embed_params = a.vocab_size * a.dim / layout.tp
    head_params = (a.dim + (a.vocab_size * a.dim if layout.pp > 1 or not a.tie_embeddings else 0)) / layout.tp

    def block_fwd(cat: str) -> list[tuple[float, str, str]]:
        a, b = split["fwd"]
        seq = [(a, "attn", cat)]
        if bc.cp_fwd:
            seq.append((bc.cp_fwd, "cp attn", "cp"))
        if ar:
            seq.append((ar, "tp " + ("ag/rs" if layout.sequence_parallel else "all-reduce"), "tp"))
        if bc.ep:
            seq.append((bc.ep / 2, "ep dispatch", "ep"))
        seq.append((b, "mlp", cat))
        if bc.ep:
            seq.append((bc.ep / 2, "ep combine", "ep"))
        if ar:
            seq.append((ar, "tp " + ("ag/rs" if layout.sequence_parallel else "all-reduce"), "tp"))
        return seq

    def block_bwd(with_input: bool, with_weight: bool) -> list[tuple[float, str, str]]:
        (ab, bb), (aw, bw) = split["bwd"], split["wgrad"]
        seq: list[tuple[float, str, str]] = []
        if with_input and ar_bwd:
            seq.append((ar_bwd, "tp grad", "tp"))
        if with_input and bc.ep:
            seq.append((bc.ep / 2, "ep combine grad", "ep"))
        if with_input:
            seq.append((bb, "mlp dgrad", "bwd"))
        if with_input and bc.ep:
            seq.append((bc.ep / 2, "ep dispatch grad", "ep"))
        if with_weight:
            seq.append((bw, "mlp wgrad", "wgrad"))
        if with_input and ar_bwd:
            seq.append((ar_bwd, "tp grad", "tp"))
        if with_input:
            seq.append((ab, "attn dgrad", "bwd"))
            if bc.cp_bwd:
                seq.append((bc.cp_bwd, "cp attn grad", "cp"))
        if with_weight:
            seq.append((aw, "attn wgrad", "wgrad"))
        return seq

    def assemble(parts: list[tuple[float, str, str] | tuple[str, float]]) -> Op:
        t, detail, ends = 0.0, [], []
        for p in parts:
            if p[0] == "bucket":
                ends.append((t, p[1]))
                continue
            dur, name, cat = p  # type: ignore[misc]
            if dur > 0:
                detail.append((t, dur, name, cat))
                t += dur
        return Op(t, detail, ends)

    fwd: list = [(emb.fwd, "embed", "fwd")] if first else []
    for _ in range(layers):
        fwd += block_fwd("fwd")
    if last:
        fwd.append((head.fwd, "head+loss", "fwd"))

    def backward(with_input: bool, with_weight: bool) -> Op:
        parts: list = []
        if last:
            if with_input:
                parts.append((head.bwd, "head dgrad", "bwd"))
            if with_weight:
                parts.append((head.wgrad, "head wgrad", "wgrad"))
                parts.append(("bucket", head_params))
        for i in reversed(range(layers)):
            if with_input and recomputed[i]:
                parts += block_fwd("recompute")
            elif with_input and core_only:
                parts.append((bc.core_fwd, "attn core", "recompute"))
            parts += block_bwd(with_input, with_weight)
            if with_weight:
                parts.append(("bucket", per_layer))
        if first and with_input:
            parts.append((emb.bwd, "embed grad", "bwd"))
        if first and with_weight:
            parts.append((emb.wgrad, "embed wgrad", "wgrad"))
            parts.append(("bucket", embed_params))
        return assemble(parts)

    params = layers * per_layer + (embed_params if first else 0.0) + (head_params if last else 0.0)
    return StageOps(
        stage,
        layers,
        first,
        last,
        assemble(fwd),
        backward(True, True),
        backward(True, False),
        backward(False, True),
        params,
    )


# --- collectives as phases ----------------------------------------------------------------------------


def _tiers(span: Span) -> list[tuple[str, int, float, float]]:
    names = [name for name, n in (("intra", span.per_node), ("fabric", span.nodes), ("wan", span.dcs)) if n > 1]
    return [(name, k, bw, lat) for name, (k, bw, lat) in zip(names, span.tiers())]


def reduce_scatter(nbytes: float, span: Span) -> list[PhaseSpec]:
    """Hierarchical reduce-scatter, inner tier first (``comm.reduce_scatter``)."""
    out: list[PhaseSpec] = []
    chunk = nbytes
    if span.size <= 1 or nbytes <= 0:
        return out
    for name, k, bw, lat in _tiers(span):
        out.append(PhaseSpec(name, (k - 1) * lat, (k - 1) / k * chunk / bw, bw))
        chunk /= k
    return out


def all_gather(nbytes: float, span: Span) -> list[PhaseSpec]:
    """Hierarchical all-gather: the reduce-scatter mirrored, outer tier first."""
    return list(reversed(reduce_scatter(nbytes, span)))


def all_reduce(nbytes: float, span: Span) -> list[PhaseSpec]:
    return reduce_scatter(nbytes, span) + all_gather(nbytes, span)


def _ring(nbytes: float, span: Span, steps: int) -> list[PhaseSpec]:
    """``comm._ring_steps`` on the ring's slowest edge."""
    edges = []
    if span.per_node > 1:
        edges.append(("intra", span.intra.bandwidth, span.intra.latency))
    if span.nodes > 1:
        edges.append(("fabric", span.fabric.bandwidth, span.fabric.latency))
    if span.dcs > 1:
        assert span.wan is not None
        edges.append(("wan", span.wan.bandwidth / span.concurrent, span.wan.latency))
    name, bw, _ = min(edges, key=lambda e: e[1])
    lat = max(e[2] for e in edges)
    return [PhaseSpec(name, steps * lat, steps * nbytes / span.size / bw, bw)]


def cross_dc_all_reduce(
    nbytes: float, span: Span, layout: LayoutSpec, runtime: Runtime
) -> tuple[list[PhaseSpec], list[PhaseSpec]]:
    """(phases every step, phases of DiLoCo's outer sync amortised over H) for ``geo.cross_dc_all_reduce``."""
    if span.dcs <= 1:
        return all_reduce(nbytes, span), []
    inside = _inside(span)
    if layout.sync == "flat":
        return _ring(nbytes, span, 2 * (span.size - 1)), []
    k, bw, lat = span.tiers()[-1]
    local = span.per_node * span.nodes
    if layout.sync == "diloco":
        delta = outer_equivalent(nbytes, k, layout, runtime)
        h = max(1, layout.inner_steps)
        wan = PhaseSpec("wan", 2 * (k - 1) * lat / h, 2 * (k - 1) / k * delta / local / bw / h, bw)
        return all_reduce(nbytes, inside), [wan]
    if layout.sync == "streaming_diloco":  # gradients stay inside; the fragments: streaming_phases
        return all_reduce(nbytes, inside), []
    ratio = runtime.compress_ratio if layout.sync == "compressed" else 1.0
    wan = PhaseSpec("wan", 2 * (k - 1) * lat, 2 * (k - 1) / k * nbytes * ratio / local / bw, bw)
    return reduce_scatter(nbytes, inside) + [wan] + all_gather(nbytes, inside), []


def streaming_phases(nbytes: float, span: Span, layout: LayoutSpec, runtime: Runtime) -> list[PhaseSpec]:
    """Streaming DiLoCo: one fragment's exchange across the WAN, per parameter of the whole model,
    spread over the ``overlap_steps`` (tau) steps it overlaps: 1 / tau of it runs behind each.

    The simulated step is one in which a fragment is in flight; `sim.run` amortises what it blocks
    (tau x its wait, every inner_steps / fragments steps), as ``geo.streaming_exposed`` does. None
    for other strategies.
    """
    if layout.sync != "streaming_diloco" or span.dcs <= 1:
        return []
    k, bw, lat = span.tiers()[-1]
    local = span.per_node * span.nodes
    eq = streaming_equivalent(nbytes, span, layout, runtime) / max(1, layout.fragments)
    tau = max(1, layout.overlap_steps)
    # Latency once per fragment (all parameters share one transfer), seconds per parameter.
    return [PhaseSpec("wan", 2 * (k - 1) * lat / tau, 2 * (k - 1) / k * eq / local / bw / tau, bw)]


@dataclass(frozen=True)
class DpPlan:
    """Data-parallel traffic of one device per parameter, as phases (multiply seconds by parameters)."""

    grad: list[PhaseSpec]
    """Gradient reduction of one bucket, per parameter."""
    outer: list[PhaseSpec]
    """DiLoCo's amortised outer sync, per parameter (blocking, after the optimizer)."""
    step_gather: list[PhaseSpec]
    """Weight gathers once per step (ZeRO-1 broadcast; ZeRO-2/3 under a pipeline), per parameter."""
    mb_gather: list[PhaseSpec]
    """Weight gathers per microbatch forward (ZeRO-3; ZeRO-2 without a pipeline), per parameter."""
    bwd_gather: bool
    """ZeRO-3 without a pipeline gathers again for every backward."""
    stream: list[PhaseSpec] = field(default_factory=list)
    """Streaming DiLoCo's fragment exchange, per parameter (behind the step's compute)."""


def dp_plan(site: SiteSpans, layout: LayoutSpec, runtime: Runtime) -> DpPlan:
    """Mirror of ``geo.dp_sync``: which collectives run, on which span, per parameter."""
    g, w = float(runtime.grad_bytes), float(runtime.weight_bytes)
    if layout.grad_sync_degree <= 1:
        return DpPlan([], [], [], [], False)
    shard = layout.shard_degree
    if shard <= 1:
        grad, outer = cross_dc_all_reduce(g, site.sync, layout, runtime)
        return DpPlan(grad, outer, [], [], False, streaming_phases(g, site.sync, layout, runtime))
    rep, outer = cross_dc_all_reduce(g / shard, site.replicate, layout, runtime)
    stream = streaming_phases(g / shard, site.replicate, layout, runtime)
    grad = reduce_scatter(g, site.shard) + rep
    gather = all_gather(w, site.shard)
    if layout.zero_stage == 1:  # reduce-scatter, then one all-gather per step (as planner.geo.dp_sync)
        return DpPlan(grad, outer, gather, [], False, stream)
    if layout.zero_stage == 3:
        # Under a pipeline once per step, and again per microbatch unless the runtime keeps them
        # gathered (as planner.geo.dp_sync).
        again = layout.pp == 1 or not runtime.gathered_across_microbatches
        return DpPlan(grad, outer, gather if layout.pp > 1 else [], gather if again else [], layout.pp == 1, stream)
    return DpPlan(grad, outer, gather if layout.pp > 1 else [], gather if layout.pp == 1 else [], False, stream)


def scale(phases: list[PhaseSpec], params: float) -> list[PhaseSpec]:
    """The phases of a buffer of ``params`` parameters (latency once, bytes in proportion)."""
    return [PhaseSpec(p.tier, p.latency, p.seconds * params, p.bandwidth) for p in phases]


def p2p_message(work: Workload, layout: LayoutSpec, runtime: Runtime) -> float:
    """Bytes one device sends to the next stage per microbatch (activation or its gradient)."""
    act = layout.micro_batch * work.seq_len / layout.cp * work.args.dim * act_bytes(work.dtype)
    return act / (layout.tp if runtime.scatter_gather or layout.sequence_parallel else 1)


def tp_gather(work: Workload, layout: LayoutSpec, site: SiteSpans) -> float:
    """Megatron's scatter/gather: the all-gather over tp after each received activation."""
    act = layout.micro_batch * work.seq_len / layout.cp * work.args.dim * act_bytes(work.dtype)
    return comm.all_gather(act, site.tp)
