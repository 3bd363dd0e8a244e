"""A Llama-style decoder laid out for tensor parallel, FSDP2 and pipeline splitting.

The layout follows torchtitan's Llama so the same parallelisation plans apply:
Linear submodules ``wq wk wv wo`` and ``w1 w2 w3`` (no biases), blocks in an
``nn.ModuleDict`` keyed by layer index (a pipeline stage deletes blocks and keeps the
names), and ``tok_embeddings`` / ``norm`` / ``output`` that a splitter may set to
``None``. No buffers at all: RoPE angles are computed from the positions in every
forward, so the model builds on the meta device and any position offset (context
parallel shards, pipeline micro-batches, generation past the trained length) works
without state.

Generation passes a `KVCache`: each attention keeps the keys and values of the
positions seen so far and the new tokens take the next positions, so a sequence is
never truncated and its positions never restart. Training passes none and runs the
same code as before the cache existed.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from isthmus.models.args import ModelArgs, check_args
from isthmus.models.ffn import FeedForward
from isthmus.models.moe import MoE

AttentionFn = Callable[[Tensor, Tensor, Tensor], Tensor]
"""``(q, k, v) -> out`` over [B, H, S, Dh]; k and v may have fewer heads than q (grouped-query attention)."""

# Name components added by wrappers (activation checkpointing, torch.compile, DDP,
# FSDP1); dropping them gives the name the parameter has in the bare model.
WRAPPER_PREFIXES = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "module", "_fsdp_wrapped_module"})
INIT_STD = 0.02


def causal_sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Default attention kernel: causal softmax attention over [B, H, S, Dh] tensors. K and V may have
    fewer heads (grouped-query attention): SDPA shares each among its query heads itself, so autograd
    keeps them at their own size rather than repeated to the query heads' (flash kernels, CPU and CUDA)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, each [S, head_dim // 2] in fp32."""
    # fp32 on purpose: with bf16 angles, positions beyond a few thousand lose the
    # low-order bits that distinguish neighbouring tokens.
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of x [B, S, H, Dh] by the angles.

    Interleaved pairs are Meta's/torchtitan's convention, so their checkpoints load without
    permuting wq/wk. Each pair is a complex number multiplied by cos + i sin, as they compute it:
    one contiguous complex multiply per tensor. The same sums written on the pairs' strided real
    views give the same bits but run several times slower on CPU (figures in dev/LOG.md).
    """
    pairs = torch.view_as_complex(x.float().contiguous().unflatten(-1, (-1, 2)))
    # fp32 angles: FSDP's mixed precision casts a block's inputs, the tables included, to bf16.
    angles = torch.complex(cos.float(), sin.float())[None, :, None, :]
    return torch.view_as_real(pairs * angles).flatten(-2).type_as(x)


@dataclass
class LayerKV:
    """One attention layer's keys and values so far, [B, S, n_kv_heads, Dh] each (after RoPE)."""

    k: Tensor | None = None
    v: Tensor | None = None

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append the new positions' keys and values; returns all of them."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=1)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=1)
        return self.k, self.v


@dataclass
class KVCache:
    """Keys and values of every layer for incremental decoding (one process, unsharded model)."""

    layers: dict[str, LayerKV] = field(default_factory=dict)
    length: int = 0
    """Positions cached so far: the next token's position."""

    def layer(self, name: str) -> LayerKV:
        return self.layers.setdefault(name, LayerKV())


def cached_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Attention of the newest q positions over all k/v positions ([B, H, S, Dh]): query i sees keys
    up to its own position. SDPA's is_causal aligns the mask to the top left, wrong when k is longer."""
    q_len, k_len = q.shape[2], k.shape[2]
    if q_len == 1:
        return F.scaled_dot_product_attention(q, k, v)
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class _RMSNormFunction(torch.autograd.Function):
    """``(x / rms(x)).type_as(x) * weight``, normalised in fp32, keeping for backward only the input
    and the per-token reciprocal RMS.

    Written by hand because torch's ``rms_norm`` off CUDA, like the same expression in eager ops,
    decomposes into steps autograd saves one by one: an fp32 copy of the input and the normalised
    value besides it (three tensors of the hidden size per norm with its output, which the next
    matmul keeps). Here backward recomputes the normalised value from the input, as fused kernels
    do. The ops are plain tensor ops, so DTensor inputs (sequence parallelism) run through them."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).type_as(x) * weight

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        grad_weight = (grad * normed.type_as(x)).sum(dim=tuple(range(grad.dim() - 1)))
        # d/dx of x * rstd(x): rstd * (g - normed * mean(g * normed)), with g the gradient of normed.
        g = (grad * weight).float()
        grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        return grad_x.type_as(x), grad_weight, None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``(x / rms(x)).type_as(x) * weight`` over the last dimension (:class:`_RMSNormFunction`)."""
    return _RMSNormFunction.apply(x, weight, eps)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale ``weight``."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query attention with rotary positions and a swappable kernel ``sdpa``; with
    ``args.qk_norm`` each query and key head is RMS-normalised before RoPE (Qwen3)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        # One scale of head_dim shared by every head, so tensor parallel's head shards keep it whole.
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.sdpa: AttentionFn = causal_sdpa

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: LayerKV | None = None) -> Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # Head counts come from the projected shapes, not from args: under tensor
        # parallel each rank holds a column shard of wq/wk/wv, hence fewer heads.
        bsz, seqlen = q.shape[0], q.shape[1]
        q, k = q.view(bsz, seqlen, -1, self.head_dim), k.view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.view(bsz, seqlen, -1, self.head_dim)
        if cache is not None:
            k, v = cache.extend(k, v)
            n_rep = q.shape[2] // k.shape[2]
            k, v = k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2)
            out = cached_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
        # Every kernel takes K and V grouped (fewer heads than Q): SDPA shares them itself, and the
        # context-parallel kernels send the grouped heads and share them locally.
        out = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + ffn(norm(.)); the ffn is a `MoE` in a MoE layer."""

    def __init__(self, args: ModelArgs, layer_id: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward: FeedForward | MoE = (
            MoE(args, layer_id) if args.moe_layer(layer_id) else FeedForward(args.dim, args.ffn_dim, args.mlp)
        )

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: LayerKV | None = None) -> Tensor:
        normed = self.attention_norm(x)
        # The cache is passed only when there is one: tensor parallel's input plans (PrepareModuleInput)
        # count the positional inputs of training's call, (x, cos, sin).
        h = x + (self.attention(normed, cos, sin) if cache is None else self.attention(normed, cos, sin, cache))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Decoder-only language model; any of tok_embeddings/norm/output may be None."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        check_args(args)
        self.args = args
        self.hidden_seq_shards = 1
        """Sequence shards of the hidden states this module receives (set by sequence parallelism)."""
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make output.weight the embedding's Parameter when tied and both exist."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn: Any, recurse: bool = True) -> Transformer:
        # to_empty()/to() give each module its own new Parameter when the device
        # changes, which silently unties the head; tie again afterwards.
        super()._apply(fn, recurse)
        self.tie_weights()
        return self

    def input_seq_len(self, tokens: Tensor) -> int:
        """This rank's sequence length, from its input: token ids, or hidden states between pipeline
        stages, which are sequence-sharded ``hidden_seq_shards`` ways under sequence parallelism."""
        if self.tok_embeddings is not None:
            return tokens.shape[1]
        return tokens.shape[1] * self.hidden_seq_shards

    def forward(self, tokens: Tensor, positions: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        """Logits [B, S, V] from tokens [B, S] (or hidden states [B, S, D] for a later stage).

        Given ``cache`` (generation: a whole unsharded model), the tokens continue the cached ones:
        their positions start at ``cache.length``, and their keys and values join the cache."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if cache is not None:
            assert positions is None, "a cached forward takes its positions from the cache"
            positions = torch.arange(cache.length, cache.length + tokens.shape[1], device=h.device)
        if positions is None:
            positions = torch.arange(self.input_seq_len(tokens), device=h.device)
        cos, sin = rope_cos_sin(positions, self.args.head_dim, self.args.rope_theta)
        for name, layer in self.layers.items():
            h = layer(h, cos, sin) if cache is None else layer(h, cos, sin, cache.layer(name))
        if cache is not None:
            cache.length += tokens.shape[1]
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def build_model(args: ModelArgs, device: torch.device | str = "meta") -> Transformer:
    """Construct the model on ``device`` (meta by default: no memory, no init)."""
    with torch.device(device):
        return Transformer(args)


def canonical_name(name: str) -> str:
    """The parameter's name in the bare model, with wrapper components removed."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PREFIXES)


def init_std(name: str, args: ModelArgs) -> float | None:
    """Std of the normal init for a canonical name; None means 'fill with ones', 0.0 'fill with zeros'.

    GPT-2/Megatron scheme: 0.02 everywhere, scaled by 1/sqrt(2 * n_layers) for the
    two projections that write into the residual stream (wo, w2), so its variance
    does not grow with depth; an untied head uses dim**-0.5 so initial logits have
    unit scale (torchtitan's choice). Norm scales start at 1. Stacked experts
    (``experts.w1`` ...) follow their Linear namesakes; a router's expert_bias starts at 0.
    """
    module = name.split(".")[-2]
    if module.endswith("norm"):
        return None
    if name.endswith("router.expert_bias"):
        return 0.0
    if module == "experts":
        module = name.split(".")[-1]
    if module in ("wo", "w2"):
        return INIT_STD / math.sqrt(2 * args.n_layers)
    if module == "output" and not args.tie_embeddings:
        return args.dim**-0.5
    return INIT_STD


def param_seed(seed: int, name: str) -> int:
    """Stable per-parameter seed: zlib.crc32 is fixed across runs, Python's hash is not.

    Seed and name are hashed together because the CPU generator (mt19937) keeps only
    the low 32 bits of its seed: packing the seed into high bits would be ignored.
    """
    return zlib.crc32(f"{seed}/{name}".encode())


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, args: ModelArgs) -> None:
    """Fill every parameter from a generator keyed on (seed, canonical name).

    Each full tensor is drawn on CPU and then sliced to this rank's shard, so the
    values do not depend on how the model was wrapped, sharded or split. The cost is
    one full-size temporary per parameter, freed before the next.
    """

    for raw_name, p in model.named_parameters():
        name = canonical_name(raw_name)
        if args.tie_embeddings and name == "output.weight":
            # A tied head on a stage without the embedding must match the embedding.
            name = "tok_embeddings.weight"
        std = init_std(name, args)
        if std is None:
            full = torch.ones(p.shape)
        elif std == 0.0:
            full = torch.zeros(p.shape)
        else:
            gen = torch.Generator().manual_seed(param_seed(seed, name))
            full = torch.randn(p.shape, generator=gen).mul_(std)
        if isinstance(p, DTensor):
            # src_data_rank=None: every rank slices its own copy, no communication.
            shard = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(shard.to_local())
        else:
            p.copy_(full)
