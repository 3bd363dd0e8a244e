"""Compute time of each operator of a transformer block on one device, from exact shapes.

A GEMM of shape (m, n, k) runs at ``gemm_fraction`` of the device's peak, a saturating curve in
each dimension with the device kind's two calibrated constants, and never faster than its operands
stream through memory. Elementwise kernels (norms, softmax, dropout, activations, residual adds)
are memory-bound: bytes moved / (memory bandwidth x achievable fraction). FLOPs follow
``isthmus.models.flops`` exactly: the sum of GEMM FLOPs over one block equals the block's share of
``flops_per_token``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from isthmus.layout.spec import LayoutSpec
from isthmus.models.args import ModelArgs
from isthmus.planner.topology import DeviceKind
from isthmus.planner.workload import Runtime, Workload

ELEM_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
FP8_HALF_DIM_SCALE = 3.0
"""An FP8 GEMM's curve saturates at this many times the device's ``gemm_half_dim``: its tensor-core
tiles are twice as deep, so small or skinny GEMMs gain less from FP8 than large ones."""
FLASH_BACKWARD_FACTOR = 2.5
"""Fused attention backward costs this many forwards (it recomputes the scores)."""
CAUSAL_SKIP = 0.5
"""Fraction of the S x S square a causal fused kernel computes (masked tiles are skipped)."""
OPTIMIZER_BYTES_PER_PARAM = 32
"""Adam step, gradient-norm and zeroing traffic per local parameter (fp32 master, m, v, grad)."""
EAGER_POINTWISE_TRAFFIC = 4.8
"""Traffic of an eager block's norms and activation over a fused kernel's (``Runtime.fused_pointwise``
false): eager RMSNorm upcasts, squares, averages, scales and casts back in separate kernels, SwiGLU
runs SiLU and the product apart. Fitted (docs/planner-checks.md names the rows)."""
OVERLAP_GEMM_SLOWDOWN = 0.25
"""Share a GEMM slows by while a tensor-parallel collective streams beside it (the SMs and memory
bandwidth the transfers take: Megatron's userbuffers reserve a few SMs, async TP's copy engines
share HBM) (assumed)."""


@dataclass(frozen=True)
class Fp8Cost:
    """What one FP8 recipe costs: its GEMM rate and the quantisation traffic around each GEMM."""

    gemm_efficiency: float
    """Fraction of the bf16 GEMM curve's share of peak an FP8 GEMM reaches of the FP8 peak."""
    cast_bytes: float
    """Bytes moved per element of an activation or gradient quantised (read bf16, write fp8, scales)."""
    transpose_bytes: float
    """Bytes per element of the transposed copy the weight-gradient GEMM reads (Hopper's FP8 GEMMs
    take one layout only): a cast-transpose of the fp8 tensor, or a requantisation from bf16 along
    the other axis when the scales follow rows or tiles."""
    gathers_fp8: bool
    """Sequence parallelism's all-gathers carry the quantised tensor (one scale per tensor survives a
    gather; per-row or per-tile scales along the gathered axis do not, so those gather bf16)."""


FP8_RECIPES: dict[str, Fp8Cost] = {
    "tensorwise": Fp8Cost(gemm_efficiency=1.0, cast_bytes=3.0, transpose_bytes=2.0, gathers_fp8=True),
    "rowwise": Fp8Cost(gemm_efficiency=0.62, cast_bytes=3.5, transpose_bytes=3.5, gathers_fp8=False),
    "blockwise": Fp8Cost(gemm_efficiency=0.90, cast_bytes=3.5, transpose_bytes=3.5, gathers_fp8=False),
    "mxfp8": Fp8Cost(gemm_efficiency=0.50, cast_bytes=3.2, transpose_bytes=3.2, gathers_fp8=False),
}
"""FP8 recipes' costs (``Runtime.fp8_recipe``). The GEMM efficiencies are fitted (docs/planner-checks.md
names the rows); the cast traffic is each kernel's reads and writes."""


def act_dtype(dtype: str) -> str:
    """The dtype of activations, elementwise kernels, attention and communication under ``dtype``:
    FP8 training quantises only the GEMMs' operands, everything else stays bf16."""
    return "bf16" if dtype == "fp8" else dtype


def act_bytes(dtype: str) -> int:
    """Bytes per element of activations under ``dtype`` (:func:`act_dtype`)."""
    return ELEM_BYTES[act_dtype(dtype)]


@dataclass(frozen=True)
class BlockShape:
    """What one transformer block computes for one microbatch on one device: the model's shape, the
    microbatch and sequence, how tensor and context parallelism split them (``sp``: sequence
    parallelism inside the tensor-parallel group), and the compute dtype."""

    args: ModelArgs
    micro_batch: int
    seq_len: int
    tp: int = 1
    cp: int = 1
    sp: bool = False
    dtype: str = "bf16"
    ep: int = 1
    """Expert parallelism of a MoE block: its ranks hold n_experts / ep experts each (1 for a dense block)."""

    @classmethod
    def of(cls, work: Workload, layout: LayoutSpec) -> BlockShape:
        """The block of ``work`` under ``layout``."""
        ep = layout.ep if work.args.is_moe else 1
        return cls(
            work.args, layout.micro_batch, work.seq_len, layout.tp, layout.cp, layout.sequence_parallel, work.dtype, ep
        )

    @property
    def local_experts(self) -> int:
        """Routed experts of each MoE layer on one rank."""
        return max(1, self.args.n_experts // self.ep)


def rank_imbalance(block: BlockShape, runtime: Runtime) -> float:
    """Routed tokens the busiest rank of an ep group computes, over the mean: the most loaded expert's
    excess (``Runtime.expert_imbalance``, capped by a capacity factor) shrunk by sqrt(experts per rank),
    loads taken as independent; 1 when one rank holds every expert (it takes the mean whatever the split)."""
    if block.ep <= 1:
        return 1.0
    imbalance = runtime.expert_imbalance
    if block.args.capacity_factor > 0:
        imbalance = min(imbalance, max(1.0, block.args.capacity_factor))
    return 1.0 + (imbalance - 1.0) / block.local_experts**0.5


def routed_tokens(block: BlockShape, runtime: Runtime) -> float:
    """Token copies the busiest rank's experts compute per microbatch: its tokens x top_k x imbalance."""
    return block.micro_batch * block.seq_len / block.cp * block.args.top_k * rank_imbalance(block, runtime)


@dataclass(frozen=True)
class Op:
    """One operator of one microbatch on one device."""

    name: str
    phase: str
    """'fwd', 'bwd' (input gradient) or 'wgrad' (weight gradient, separable for zero-bubble)."""
    flops: float
    nbytes: float
    seconds: float


def gemm_fraction(kind: DeviceKind, m: float, n: float, k: float, dtype: str = "bf16") -> float:
    """Achievable fraction of peak of an (m x k) @ (k x n) GEMM: saturates as each dim grows."""
    d0 = kind.gemm_half_dim * (FP8_HALF_DIM_SCALE if dtype == "fp8" else 1.0)
    return kind.gemm_max_fraction * (m / (m + d0)) * (n / (n + d0)) * (k / (k + d0))


def attention_fraction(kind: DeviceKind, s_local: float, seq_len: float) -> float:
    """Achievable fraction of peak of a fused attention kernel over (s_local, seq_len) score tiles: the
    GEMM curve in those two dimensions (the head dimension is the kernel's design point, not a GEMM's
    inner dimension) at the device kind's ``attention_fraction``."""
    d0 = kind.gemm_half_dim
    return kind.gemm_max_fraction * (s_local / (s_local + d0)) * (seq_len / (seq_len + d0)) * kind.attention_fraction


def gemm_time(
    kind: DeviceKind, dtype: str, m: float, n: float, k: float, batch: float = 1, recipe: str = "tensorwise"
) -> float:
    """Seconds for ``batch`` GEMMs of (m, n, k): compute at the curve, bounded below by memory traffic.
    FP8 GEMMs run at their recipe's share of the curve (:data:`FP8_RECIPES`) and write bf16."""
    e = ELEM_BYTES[dtype]
    fraction = gemm_fraction(kind, m, n, k, dtype)
    if dtype == "fp8":
        fraction *= FP8_RECIPES[recipe].gemm_efficiency
    compute = 2 * m * n * k * batch / (kind.peak(dtype) * fraction)
    memory = (
        (e * (m * k + k * n) + act_bytes(dtype) * m * n) * batch / (kind.memory_bandwidth * kind.memory_bw_fraction)
    )
    return kind.kernel_launch_s + max(compute, memory)


def memory_time(kind: DeviceKind, nbytes: float, kernels: int = 1) -> float:
    """Seconds for elementwise kernels moving ``nbytes`` through device memory."""
    return kernels * kind.kernel_launch_s + nbytes / (kind.memory_bandwidth * kind.memory_bw_fraction)


def _gemm_ops(
    kind: DeviceKind,
    dtype: str,
    name: str,
    m: float,
    n: float,
    k: float,
    batch: float = 1,
    recipe: str = "tensorwise",
    input_share: float = 1.0,
) -> list[Op]:
    """Forward GEMM and its two backward GEMMs: dX = dY W^T (m, k, n) and dW = X^T dY (k, n, m).
    Under FP8 each also quantises what it reads: the forward its input (and the transposed copy the
    weight gradient reads), the backward the output's gradient. Weights are quantised once per step,
    not per microbatch (Transformer Engine caches them; FSDP2's float8 gathers them quantised), so
    that cast is left out. ``input_share``: the share of the input this rank quantises (1 / tp where
    sequence parallelism gathers it already quantised: each rank casts its own shard)."""
    e, f = ELEM_BYTES[dtype], 2 * m * n * k * batch
    ops = [
        Op(name, "fwd", f, e * (m * k + k * n + m * n) * batch, gemm_time(kind, dtype, m, n, k, batch, recipe)),
        Op(
            name + ".dgrad",
            "bwd",
            f,
            e * (m * n + n * k + m * k) * batch,
            gemm_time(kind, dtype, m, k, n, batch, recipe),
        ),
        Op(
            name + ".wgrad",
            "wgrad",
            f,
            e * (m * k + m * n + k * n) * batch,
            gemm_time(kind, dtype, k, n, m, batch, recipe),
        ),
    ]
    if dtype == "fp8":
        fp8 = FP8_RECIPES[recipe]
        fwd_cast = (fp8.cast_bytes + fp8.transpose_bytes) * m * k * batch * input_share
        bwd_cast = (fp8.cast_bytes + fp8.transpose_bytes) * m * n * batch
        ops += [
            Op(name + ".cast", "fwd", 0.0, fwd_cast, memory_time(kind, fwd_cast)),
            Op(name + ".cast.bwd", "bwd", 0.0, bwd_cast, memory_time(kind, bwd_cast)),
        ]
    return ops


def _mem_ops(kind: DeviceKind, name: str, fwd_bytes: float, kernels: int = 1) -> list[Op]:
    """An elementwise op; its backward reads the saved input and the gradient and writes one: ~2x."""
    return [
        Op(name, "fwd", 0.0, fwd_bytes, memory_time(kind, fwd_bytes, kernels)),
        Op(name + ".bwd", "bwd", 0.0, 2 * fwd_bytes, memory_time(kind, 2 * fwd_bytes, kernels)),
    ]


def layer_ops(kind: DeviceKind, block: BlockShape, runtime: Runtime) -> list[Op]:
    """Every operator of one transformer block for one microbatch on one device."""
    dtype, args, micro_batch, seq_len = block.dtype, block.args, block.micro_batch, block.seq_len
    tp, cp, sp = block.tp, block.cp, block.sp
    e, recipe, adt = act_bytes(dtype), runtime.fp8_recipe, act_dtype(dtype)
    h, hd, f = args.dim, args.head_dim, args.ffn_dim
    q, kv = args.n_heads * hd, args.n_kv_heads * hd
    s_local = seq_len / cp
    tokens = micro_batch * s_local
    heads = args.n_heads / tp
    rep = tokens / tp if sp else tokens  # norms and residual adds run on all tokens unless sp shards them
    mask = 1 if runtime.dropout else 0
    ops: list[Op] = []
    ops += _mem_ops(kind, "norm1", 2 * e * rep * h)
    # Under sequence parallelism a recipe whose scales survive the gather casts each rank's shard.
    share = 1 / tp if sp and dtype == "fp8" and FP8_RECIPES[recipe].gathers_fp8 else 1.0
    ops += _gemm_ops(kind, dtype, "qkv", tokens, (q + 2 * kv) / tp, h, recipe=recipe, input_share=share)
    if runtime.attention == "materialized":
        scores = micro_batch * heads * s_local * seq_len
        ops += _gemm_ops(kind, adt, "attn.scores", s_local, seq_len, hd, micro_batch * heads)
        ops += _mem_ops(kind, "attn.softmax", 2 * e * scores)
        if runtime.dropout:
            ops += _mem_ops(kind, "attn.dropout", (2 * e + 1) * scores)
        ops += _gemm_ops(kind, adt, "attn.values", s_local, hd, seq_len, micro_batch * heads)
    else:
        flops = 4 * micro_batch * heads * s_local * seq_len * hd
        fwd = kind.kernel_launch_s + CAUSAL_SKIP * flops / (kind.peak(adt) * attention_fraction(kind, s_local, seq_len))
        ops += [
            Op("attn.flash", "fwd", flops, 0.0, fwd),
            Op("attn.flash.bwd", "bwd", 2 * flops, 0.0, FLASH_BACKWARD_FACTOR * fwd),
        ]
    ops += _gemm_ops(kind, dtype, "proj", tokens, h, q / tp, recipe=recipe)
    ops += _mem_ops(kind, "residual1", (3 * e + mask) * rep * h)
    ops += _mem_ops(kind, "norm2", 2 * e * rep * h)
    if args.is_moe:
        ops += moe_ops(kind, block, runtime)
    else:
        branches = 2 if args.mlp == "swiglu" else 1
        ops += _gemm_ops(kind, dtype, "fc1", tokens, branches * f / tp, h, recipe=recipe, input_share=share)
        ops += _mem_ops(kind, "act", (branches + 1) * e * tokens * f / tp)
        ops += _gemm_ops(kind, dtype, "fc2", tokens, h, f / tp, recipe=recipe)
    ops += _mem_ops(kind, "residual2", (3 * e + mask) * rep * h)
    if not runtime.fused_pointwise:
        ops = [_eager(op) if op.name.split(".")[0] in ("norm1", "norm2", "act") else op for op in ops]
    return ops


def _eager(op: Op) -> Op:
    """An elementwise op as eager PyTorch runs it: several kernels, :data:`EAGER_POINTWISE_TRAFFIC` the bytes."""
    return replace(op, nbytes=op.nbytes * EAGER_POINTWISE_TRAFFIC, seconds=op.seconds * EAGER_POINTWISE_TRAFFIC)


def moe_ops(kind: DeviceKind, block: BlockShape, runtime: Runtime) -> list[Op]:
    """A MoE block's feed-forward on one device for one microbatch: the router, the permutation of
    token copies into expert order and back, the routed experts as one grouped GEMM per matmul (each
    local expert's rows, split over tp like a dense MLP) and the shared experts. The experts run at the
    busiest rank's load (:func:`rank_imbalance`); their FLOPs are counted at the mean, as model FLOPs.
    A DeepSeek-style model's first dense blocks are priced as MoE blocks."""
    dtype, args, tp, recipe = block.dtype, block.args, block.tp, runtime.fp8_recipe
    e, h, fe = act_bytes(dtype), args.dim, args.expert_ffn_dim
    tokens = block.micro_batch * block.seq_len / block.cp
    rep = tokens / tp if block.sp else tokens
    local = block.local_experts
    routed = routed_tokens(block, runtime)
    mean = routed / rank_imbalance(block, runtime)
    ops = _gemm_ops(kind, act_dtype(dtype), "router", rep, args.n_experts, h)
    # Dispatch gathers each token copy into expert order; combine scatters it back and sums top_k copies.
    ops += _mem_ops(kind, "moe.permute", 4 * e * routed * h, kernels=2)
    experts = _gemm_ops(kind, dtype, "experts.fc1", routed / local, 2 * fe / tp, h, local, recipe)
    experts += _mem_ops(kind, "experts.act", 3 * e * routed * fe / tp)
    experts += _gemm_ops(kind, dtype, "experts.fc2", routed / local, h, fe / tp, local, recipe)
    ops += [replace(op, flops=op.flops * mean / routed) for op in experts]
    if args.n_shared_experts:
        fs = args.n_shared_experts * fe
        ops += _gemm_ops(kind, dtype, "shared.fc1", tokens, 2 * fs / tp, h, recipe=recipe)
        ops += _mem_ops(kind, "shared.act", 3 * e * tokens * fs / tp)
        ops += _gemm_ops(kind, dtype, "shared.fc2", tokens, h, fs / tp, recipe=recipe)
    return ops


def head_ops(kind: DeviceKind, block: BlockShape, fused_cross_entropy: bool = False) -> list[Op]:
    """Final norm, output projection (vocabulary split over tp) and cross-entropy of one microbatch.
    The output projection stays in the activations' dtype under FP8 (recipes leave it out)."""
    dtype, args, micro_batch, seq_len = act_dtype(block.dtype), block.args, block.micro_batch, block.seq_len
    tp, cp, sp = block.tp, block.cp, block.sp
    e = ELEM_BYTES[dtype]
    tokens = micro_batch * seq_len / cp
    logits = tokens * args.vocab_size / tp
    rep = tokens / tp if sp else tokens
    ops = _mem_ops(kind, "final_norm", 2 * e * rep * args.dim)
    ops += _gemm_ops(kind, dtype, "head", tokens, args.vocab_size / tp, args.dim)
    if fused_cross_entropy:  # one pass over the logits each way, no fp32 copy
        return ops + [
            Op("loss", "fwd", 0.0, e * logits, memory_time(kind, e * logits)),
            Op("loss.bwd", "bwd", 0.0, 2 * e * logits, memory_time(kind, 2 * e * logits)),
        ]
    # fp32 softmax cross-entropy: read logits, write fp32 probabilities, reduce; backward writes grads.
    ops += [
        Op("loss", "fwd", 0.0, 12 * logits, memory_time(kind, 12 * logits, 3)),
        Op("loss.bwd", "bwd", 0.0, 8 * logits, memory_time(kind, 8 * logits, 2)),
    ]
    return ops


def embedding_ops(kind: DeviceKind, block: BlockShape) -> list[Op]:
    e = act_bytes(block.dtype)
    nbytes = e * block.micro_batch * block.seq_len / block.cp * block.args.dim
    return [
        Op("embed", "fwd", 0.0, nbytes, memory_time(kind, nbytes)),
        Op("embed.bwd", "bwd", 0.0, 2 * nbytes, memory_time(kind, 2 * nbytes)),
    ]


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds of one microbatch through some ops: forward, input-gradient and weight-gradient backward."""

    fwd: float
    bwd: float
    wgrad: float
    flops_fwd: float

    @property
    def backward(self) -> float:
        return self.bwd + self.wgrad


def sum_phases(ops: list[Op]) -> PhaseTimes:
    t = {"fwd": 0.0, "bwd": 0.0, "wgrad": 0.0}
    for op in ops:
        t[op.phase] += op.seconds
    return PhaseTimes(t["fwd"], t["bwd"], t["wgrad"], sum(op.flops for op in ops if op.phase == "fwd"))


@lru_cache(maxsize=4096)
def layer_times(kind: DeviceKind, block: BlockShape, runtime: Runtime) -> PhaseTimes:
    """Cached :func:`layer_ops` totals (the search calls this for every candidate)."""
    return sum_phases(layer_ops(kind, block, runtime))


@lru_cache(maxsize=4096)
def attention_core_fwd(kind: DeviceKind, block: BlockShape, runtime: Runtime) -> float:
    """Seconds of one block's attention core forward (scores, softmax, dropout, values; or the fused
    kernel): what selective recomputation of the attention core runs again before the backward."""
    ops = layer_ops(kind, block, runtime)
    return sum(op.seconds for op in ops if op.phase == "fwd" and op.name.startswith("attn."))


@lru_cache(maxsize=4096)
def ends_times(kind: DeviceKind, block: BlockShape, fused_cross_entropy: bool = False) -> tuple[PhaseTimes, PhaseTimes]:
    """(embedding, head + loss) times of one microbatch: the first and last pipeline stage's extras."""
    return sum_phases(embedding_ops(kind, block)), sum_phases(head_ops(kind, block, fused_cross_entropy))


def optimizer_time(kind: DeviceKind, local_params: float) -> float:
    """Seconds of the optimizer step over the parameters this device updates."""
    return memory_time(kind, OPTIMIZER_BYTES_PER_PARAM * local_params, kernels=4)


def shard_collectives(zero_stage: int, shard: int, pp: int, microbatches_per_step: int) -> int:
    """FSDP2 collectives per block and step, as ``geo.dp_sync`` counts them: ZeRO-2 gathers per
    microbatch (once per step under a pipeline), ZeRO-3 per forward and per backward (a pipeline
    keeps the step's first gather), and one reduce-scatter per step."""
    if shard <= 1 or zero_stage == 1:
        return 0
    m = microbatches_per_step
    gathers = (m if pp == 1 else 1) if zero_stage == 2 else (2 * m if pp == 1 else m + 1)
    return gathers + 1


def shard_overhead(kind: DeviceKind, layout: LayoutSpec, layers: int) -> float:
    """Seconds of FSDP2's runtime work per step on a device holding ``layers`` blocks (``kind.shard_block_s``
    per block and collective; 0 unless a profile measured it)."""
    if not kind.shard_block_s:
        return 0.0
    n = shard_collectives(layout.zero_stage, layout.shard_degree, layout.pp, layout.microbatches_per_step)
    return kind.shard_block_s * layers * n
