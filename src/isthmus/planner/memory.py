"""Memory per device: model state by ZeRO stage, activations by Korthikanti et al. 2022.

Activations of one block for one microbatch of b sequences of s tokens (bytes, e = 2 for bf16),
for a GPT block (multi-head attention, 4h GELU MLP, dropout, softmax over a stored score matrix):

    no parallelism          s b h (34 + 5 a s / h)
    tensor parallel t       s b h (10 + 24/t + 5 a s / (h t))
    tp + sequence parallel  s b h (34/t + 5 a s / (h t))
    full recomputation      2 s b h   (the block input; / t with sequence parallelism)
    selective (attention)   s b h (34/t)  with tp + sp: the 5as/h score tensors are recomputed

:func:`layer_activation_bytes` builds these from their parts, so grouped-query attention, SwiGLU,
no dropout and fused attention (no S x S tensor) follow from the same accounting, and reproduces the
table exactly for a GPT block (tests/planner/test_planner_cost.py checks it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from isthmus.layout import rules
from isthmus.models.args import ModelArgs
from isthmus.models.flops import layer_matmul_params
from isthmus.planner.compute import ELEM_BYTES, BlockShape, act_bytes, act_dtype, routed_tokens
from isthmus.planner.workload import Runtime

USABLE_FRACTION = 0.95
"""Share of device memory the plan may fill; the rest is context, communication buffers, fragmentation.
0.95 because published runs filled more than 0.9: torchtitan's Llama 3.1 8B on 8 H100 96GB (FSDP,
local batch 2, selective recomputation) reported 82.4 GiB, 92% of the device."""


SHARED_FILE_LINE = 64
SHARED_FILE_MIN_SLOT = 1 << 20
SHARED_FILE_MAX_SLOT = 256 << 20
"""The file layout of ``isthmus.parallel.shm_collectives`` (which the planner may not import; its
test holds these equal): one cache line per rank's counter, then two banks of one slot per rank, a
slot the largest tensor served rounded up to a power of two, 1 MiB to 256 MiB."""


def shared_file_bytes(tp: int, largest: float) -> float:
    """Bytes of the shared file a tensor-parallel group of ``tp`` CPU ranks on one host exchanges
    through, which every rank maps and reads whole: ``largest`` is the group's largest collective
    (a block's hidden states: an all-reduce, or the input of sequence parallelism's reduce-scatter)."""
    served = int(min(largest, SHARED_FILE_MAX_SLOT))
    slot = max(SHARED_FILE_MIN_SLOT, 1 << max(0, served - 1).bit_length())
    return SHARED_FILE_LINE * tp + 2 * tp * slot


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device at its peak."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    transient: float
    """Gathered ZeRO-3 / FSDP parameters, the recomputed block, logits of the last stage, torch
    pipelining's receive buffers (one per microbatch and stage module: many microbatches cost here),
    and under bf16 autocast the cached bf16 copies of the rank's weights."""

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.transient


def alternate_share(layers: int, virtual_stages: int) -> float:
    """Share of a rank's ``layers`` blocks that every-other-block recomputation wraps: the runtime
    wraps blocks 0, 2, 4, ... of each stage module (``parallel.ac.apply_ac``), so a rank whose
    ``virtual_stages`` modules hold k blocks each recomputes ceil(k / 2) of every k: all of them
    with one block per module (a deep interleaved pipeline), half with an even count."""
    if layers <= 0:
        return 0.5
    return sum((k + 1) // 2 for k in _module_sizes(layers, virtual_stages)) / layers


def _module_sizes(layers: int, virtual_stages: int) -> list[int]:
    base, extra = divmod(layers, max(1, virtual_stages))
    return [base + (1 if c < extra else 0) for c in range(max(1, virtual_stages))]


def layer_activation_bytes(block: BlockShape, runtime: Runtime, scores: bool = True, fsdp: bool = False) -> float:
    """Bytes one block keeps for backward, for one microbatch, without recomputation (``scores=False``:
    without the attention core's S x S tensors, which attention-core selective recomputation drops).
    ``fsdp``: the layout's data parallelism is FSDP2, whose mixed precision isthmus computes bf16
    under instead of autocast (:func:`fsdp_mixed_precision`)."""
    args, micro_batch, seq_len, tp, cp, sp, dtype = (
        block.args,
        block.micro_batch,
        block.seq_len,
        block.tp,
        block.cp,
        block.sp,
        block.dtype,
    )
    e = act_bytes(dtype)
    sb = micro_batch * seq_len / cp
    h, hd, f = args.dim, args.head_dim, args.ffn_dim
    q, kv = args.n_heads * hd, args.n_kv_heads * hd
    mask = 1 if runtime.dropout else 0
    fsdp_mp = fsdp_mixed_precision(runtime, dtype, fsdp)
    autocast = runtime.autocast and dtype == "bf16" and not fsdp_mp
    # isthmus's own block, whatever its precision, keeps what eager autograd keeps.
    eager = (runtime.eager_llama_block or runtime.autocast) and not runtime.pointwise_recompute
    gathered = 0.0
    if autocast:
        # Under bf16 autocast over fp32 weights (``Runtime.autocast``): each norm's fp32 input
        # outside the tensor-parallel regions (isthmus's RMSNorm keeps no more), and a bf16 copy of
        # its fp32 output per matmul reading it (wq, wk, wv; w1 and w3, or fc1), each made by that
        # matmul's own cast, under sequence parallelism of the all-gathered output. The weights'
        # bf16 copies are :func:`autocast_weight_copy_bytes`.
        outside = sb * h * (2 * ELEM_BYTES["fp32"] + 2 * mask)
        gathered = (3 + (2 if args.mlp == "swiglu" else 1)) * e * sb * h
    else:
        # Outside the tensor-parallel regions (replicated over tp unless sequence-parallel):
        # two norm inputs, the QKV and fc1 inputs (the norms' outputs), two dropout masks.
        per_norm = 1 if runtime.pointwise_recompute else 2
        outside = sb * h * (2 * per_norm * e + 2 * mask)
        if sp and tp > 1 and eager:
            # isthmus's sequence parallelism (torch's plans too) all-gathers each norm's output for
            # the matmuls after it, which keep the gathered copy (Megatron keeps the shard and
            # gathers again in backward).
            outside -= 2 * sb * h * e
            gathered = 2 * sb * h * e
    # Inside (split over tp): Q, K, V, attention output (proj input), MLP activations: SwiGLU's two
    # projections, the SiLU and the product (the fc2 input); GELU's input and output. Recomputing
    # pointwise results keeps only what the matmuls produced. Every attention kernel of isthmus takes
    # grouped K and V as they are (SDPA's enable_gqa, the context-parallel kernels' own grouping).
    per_unit = (2 if args.mlp == "swiglu" else 1) * (1 if runtime.pointwise_recompute else 2) * e
    if args.is_moe:
        # Each routed token copy keeps its expert's projections like a dense SwiGLU, at the busiest
        # rank's load; the copies themselves (the experts' input, whole over tp) stay for the weight
        # gradients. The shared experts keep theirs per token.
        routed = routed_tokens(block, runtime)
        mlp = per_unit * (routed * args.expert_ffn_dim + sb * args.n_shared_experts * args.expert_ffn_dim)
        gathered += e * routed * h
    else:
        mlp = per_unit * sb * f
    inside = e * sb * (q + 2 * kv + q) + mlp
    if runtime.attention == "materialized" and scores:
        square = micro_batch * args.n_heads * (seq_len / cp) * seq_len
        inside += square * (e + (e + 1) * mask)  # softmax output; dropout mask and output
    return outside / (tp if sp else 1) + gathered + inside / tp


def fsdp_mixed_precision(runtime: Runtime, dtype: str, fsdp: bool) -> bool:
    """Whether the runtime computes this bf16 layout through FSDP2's mixed precision: isthmus
    (``Runtime.autocast``) does wherever FSDP2 holds the weights, the rule its runtime applies
    (`isthmus.layout.rules.compute_precision`)."""
    return runtime.autocast and rules.compute_precision(dtype, "fsdp" if fsdp else "none") == "fsdp_mixed_precision"


def gathered_weight_bytes(runtime: Runtime, dtype: str, fsdp: bool) -> float | None:
    """Bytes per element of the weights FSDP2 gathers to compute with under its mixed precision
    (``model_state_bytes``'s ``gathered_bytes``), or None where the runtime does not use it."""
    return ELEM_BYTES[dtype] if fsdp_mixed_precision(runtime, dtype, fsdp) else None


def autocast_weight_copy_bytes(
    args: ModelArgs, layers: int, last: bool, tp: int, runtime: Runtime, dtype: str, fsdp: bool = False, ep: int = 1
) -> float:
    """The bf16 copies of a rank's matmul weights (its blocks', and the head's on the last stage) that
    autocast's cast cache holds from the first forward of an autocast region to its end: isthmus runs
    each microbatch's forward and backward, or a pipeline schedule's whole step, in one region, so
    the rank holds one copy for the step whatever its recomputation or microbatches in flight
    (every microbatch's matmuls save the same cached tensor; a recomputed block's copy stays cached
    though its activations go). Under FSDP they are copies of the gathered weights: ZeRO-3 does not
    shard them. 0 unless ``runtime.autocast`` and bf16, and where FSDP2 holds the weights (``fsdp``:
    isthmus then computes through FSDP's mixed precision, without autocast)."""
    if not (runtime.autocast and dtype == "bf16") or fsdp:
        return 0.0
    return 2 * (layers * held_layer_params(args, ep) + (args.vocab_size * args.dim if last else 0)) / tp


def layer_input_bytes(block: BlockShape) -> float:
    """What a fully recomputed block keeps: its input."""
    b = block
    return act_bytes(b.dtype) * b.micro_batch * b.seq_len / b.cp * b.args.dim / (b.tp if b.sp else 1)


def stage_params(args: ModelArgs, layers: int, first: bool, last: bool, pp: int) -> float:
    """Parameters a pipeline rank holds (before tensor parallelism).

    With pp > 1 the embedding and the head live on different ranks, so a tied flavour is held twice
    (Megatron keeps both copies in sync; isthmus unties them).
    """
    n = layers * (layer_matmul_params(args) + 2 * args.dim)
    table = args.vocab_size * args.dim
    if first:
        n += table
    if last:
        n += args.dim + (table if (pp > 1 or not args.tie_embeddings) else 0)
    return float(n)


def stage_expert_params(args: ModelArgs, layers: int) -> float:
    """The routed experts' weights among :func:`stage_params` of a rank holding ``layers`` blocks (every
    block counted as a MoE block, as ``layer_matmul_params`` counts a MoE model's blocks)."""
    return float(layers * args.n_experts * 3 * args.dim * args.expert_ffn_dim) if args.is_moe else 0.0


def held_layer_params(args: ModelArgs, ep: int = 1) -> float:
    """Matmul weights of one block a rank holds (before tp): a MoE block's routed experts over ``ep``."""
    return layer_matmul_params(args) - (1 - 1 / max(1, ep)) * stage_expert_params(args, 1)


def moe_state_bytes(
    params: float,
    experts: float,
    ep: int,
    zero_stage: int,
    shard: int,
    runtime: Runtime,
    accumulate: bool = False,
    pp: int = 1,
    gathered_bytes: float | None = None,
) -> tuple[float, float, float]:
    """:func:`model_state_bytes` of ``params`` of which ``experts`` are routed experts: those split over
    ``ep`` ranks, what is left of the shard group (dp_shard x cp / ep) sharding them; the rest as
    the layout shards it. The same as ``model_state_bytes`` for a dense model or ep 1."""
    if experts <= 0 or ep <= 1:
        return model_state_bytes(params, zero_stage, shard, runtime, accumulate, pp, gathered_bytes)
    dense = model_state_bytes(params - experts, zero_stage, shard, runtime, accumulate, pp, gathered_bytes)
    mine = model_state_bytes(experts / ep, zero_stage, max(1, shard // ep), runtime, accumulate, pp, gathered_bytes)
    return dense[0] + mine[0], dense[1] + mine[1], dense[2] + mine[2]


def model_state_bytes(
    params: float,
    zero_stage: int,
    shard: int,
    runtime: Runtime,
    accumulate: bool = False,
    pp: int = 1,
    gathered_bytes: float | None = None,
) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes on one device holding ``params`` (after tp), sharded over ``shard``.

    ZeRO-1 shards the optimizer state, ZeRO-2 also the gradients, ZeRO-3 also the weights. As FSDP2
    runs them: gradients accumulated over several microbatches stay unsharded until the last one
    (``set_requires_gradient_sync(False)``), ZeRO-2 keeps the weights gathered from forward to
    backward, and under a pipeline schedule the weights stay gathered across microbatches.
    ``gathered_bytes``: under FSDP2's mixed precision, the bytes per element of the gathered compute
    copy (2 for bf16), kept beside the fp32 shard when the weights stay gathered (at any shard
    size: FSDP2 over one rank casts a copy too); accumulated gradients stay fp32 (FSDP2 upcasts them
    to the reduce dtype).
    """
    w, g, o = (params * runtime.weight_bytes, params * runtime.grad_bytes, params * runtime.optimizer_bytes)
    if gathered_bytes is not None:
        shard = max(1, shard)
        if zero_stage == 1:  # FSDP2 replicating next to tp/pp/cp: only the optimizer state is sharded
            return w + params * gathered_bytes, g, o / shard
        held = zero_stage != 3 or pp > 1
        weights = w / shard + (params * gathered_bytes if held else 0.0)
        return weights, (g if accumulate else g / shard), o / shard
    if shard <= 1:
        return w, g, o
    if zero_stage == 1:
        return w, g, o / shard
    grads = g if accumulate else g / shard
    weights = w if zero_stage == 2 or pp > 1 else w / shard
    # The sharded fp32 copy of the weights stays too when the gathered one is held.
    weights += w / shard if weights == w else 0.0
    return weights, grads, o / shard


def device_memory(
    block: BlockShape,
    runtime: Runtime,
    *,
    layers: int,
    first: bool,
    last: bool,
    pp: int,
    activation_checkpoint: str,
    in_flight: float,
    zero_stage: int,
    shard: int,
    accumulate: bool = False,
    microbatches: int = 1,
    virtual_stages: int = 1,
    modules: Sequence[int] | None = None,
    fsdp: bool = False,
    tp_shared_file: bool = False,
) -> MemoryBreakdown:
    """Peak memory of one device of one pipeline rank holding ``layers`` of ``block``. ``modules``: the blocks of each of its stage
    modules (default: ``layers`` split evenly over ``virtual_stages``), what every-other-block
    recomputation goes by: it wraps blocks 0, 2, ... of each module (:func:`alternate_share`).
    ``fsdp``: FSDP2 holds the weights (``LayoutSpec.data_parallel_kind``), with its mixed precision
    under bf16 where the runtime uses it (:func:`fsdp_mixed_precision`). ``tp_shared_file``: the
    tensor-parallel collectives go through a shared file on the host (:func:`shared_file_bytes`)."""
    args, micro_batch, seq_len, tp, cp, sp, dtype = (
        block.args,
        block.micro_batch,
        block.seq_len,
        block.tp,
        block.cp,
        block.sp,
        block.dtype,
    )
    sizes = list(modules) if modules is not None else _module_sizes(max(1, layers), virtual_stages)
    wrapped = sum((k + 1) // 2 for k in sizes) / max(1, layers)
    # Backward starts at a module's last block with every stored activation held: recomputing it
    # (a module with an odd count) adds to the peak; a wrapped block met later is recomputed after
    # the unwrapped block above it has freed as much.
    wraps_last = any(k % 2 == 1 for k in sizes)
    params = stage_params(args, layers, first, last, pp) / tp
    gathered = gathered_weight_bytes(runtime, dtype, fsdp)
    fsdp_mp = gathered is not None
    experts = stage_expert_params(args, layers) / tp
    w, g, o = moe_state_bytes(params, experts, block.ep, zero_stage, shard, runtime, accumulate, pp, gathered)
    full = layer_activation_bytes(block, runtime, fsdp=fsdp)
    # The residual stream (a block's input, what travels between stages) stays fp32 under autocast.
    residual = "fp32" if runtime.autocast and not fsdp_mp else act_dtype(dtype)
    kept = layer_input_bytes(replace(block, dtype=residual))
    if activation_checkpoint == "full":
        per_layer = kept
    elif activation_checkpoint == "selective" and runtime.selective == "attention_core":
        per_layer = layer_activation_bytes(block, runtime, scores=False, fsdp=fsdp)
    elif activation_checkpoint == "selective":  # isthmus: every other block fully recomputed
        per_layer = wrapped * kept + (1 - wrapped) * full
    else:
        per_layer = full
    activations = layers * per_layer * in_flight
    e = act_bytes(dtype)
    # An FP8 run's weights take no more than the runtime's weight bytes: Megatron's FP8 parameters (the
    # weight and its transpose, a byte each) stand in for the bf16 copy beside the fp32 master, and
    # FSDP2's float8 gathers them quantised for the step's GEMMs only.
    # The block being recomputed: with every other block wrapped, only when backward starts at one.
    recomputes_on_top = activation_checkpoint == "full" or (
        activation_checkpoint == "selective" and (runtime.selective == "attention_core" or wraps_last)
    )
    transient = full if recomputes_on_top else 0.0
    transient += autocast_weight_copy_bytes(args, layers, last, tp, runtime, dtype, fsdp, block.ep)
    if pp > 1 and runtime.pp_recv_buffers:
        # torch pipelining keeps a receive buffer per microbatch for each stage module's input (but
        # the first's) and its output's gradient (but the last's), allocated once and kept.
        ends = 2 * len(sizes) - int(first) - int(last)
        transient += ends * microbatches * kept
    if (shard > 1 or gathered is not None) and zero_stage == 3 and pp == 1:
        gathered_w = gathered if gathered is not None else runtime.weight_bytes
        transient += 2 * (held_layer_params(args, block.ep) / tp) * gathered_w  # this and the prefetched block
    hidden = ELEM_BYTES[residual] * micro_batch * seq_len / cp * args.dim  # one microbatch's hidden states
    if tp > 1 and tp_shared_file:  # kept from the first collective on, like the receive buffers above
        transient += shared_file_bytes(tp, hidden)
    if first:
        activations += hidden * in_flight / (tp if sp else 1)
    if last:  # logits, and unless the loss is fused its fp32 softmax and gradient
        transient += (e + (0 if runtime.fused_cross_entropy else 8)) * micro_batch * seq_len / cp * args.vocab_size / tp
    return MemoryBreakdown(w, g, o, activations, transient)
