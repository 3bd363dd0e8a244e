"""Hugging Face tensor names and rotary layout <-> isthmus's, for the architectures of `hf_config`.

isthmus rotates adjacent pairs (x[2i], x[2i+1]) as Meta's original Llama does; transformers rotates
halves (x[i], x[i + head_dim/2]). The two compute the same function once the rows of wq and wk are
permuted within each head, and with them the entries of Qwen3's per-head q/k norm scales.
``to_hf_rows`` is the permutation transformers' ``convert_llama_weights_to_hf.py`` applies to Meta
weights; ``from_hf_rows`` is its inverse. Both are pure index moves, so a round trip is bit-exact.

Experts: isthmus keeps each MoE layer's experts stacked, ``experts.w1`` [n_experts, ffn, dim]; HF
checkpoints hold one tensor per expert (``experts.{e}.w1.weight`` in Mixtral's, ``experts.{e}.gate_proj.weight``
in Qwen3-MoE's: what transformers 4 writes, and transformers 5 too, which stacks them only in memory).
A file of transformers 5's in-memory names (``mlp.experts.gate_up_proj`` [n_experts, 2 ffn, dim], gate
rows then up rows, and ``mlp.experts.down_proj``), which it also loads, is read as well (``fused``).
The router's ``expert_bias`` (the bias load-balancing method's) has no HF counterpart: it is zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from isthmus.models.args import ModelArgs
from isthmus.models.hf_config import MIXTRAL, hf_arch_for

_EMBED = "model.embed_tokens.weight"
# Per block: isthmus's name after "layers.{i}." -> HF's after "model.layers.{i}.".
_ATTENTION_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_QK_NORM_NAMES = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_MLP_NAMES = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
# A MoE block: the router and the stacked experts; {e} is the expert's index.
_MIXTRAL_MOE_NAMES = {
    "feed_forward.router.gate.weight": "block_sparse_moe.gate.weight",
    "feed_forward.experts.w1": "block_sparse_moe.experts.{e}.w1.weight",
    "feed_forward.experts.w3": "block_sparse_moe.experts.{e}.w3.weight",
    "feed_forward.experts.w2": "block_sparse_moe.experts.{e}.w2.weight",
}
_QWEN3_MOE_NAMES = {
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.experts.w1": "mlp.experts.{e}.gate_proj.weight",
    "feed_forward.experts.w3": "mlp.experts.{e}.up_proj.weight",
    "feed_forward.experts.w2": "mlp.experts.{e}.down_proj.weight",
}
# transformers 5's in-memory layout, both architectures: (name, half of a gate_up tensor, see HfTensor.half).
_FUSED_MOE_NAMES = {
    "feed_forward.router.gate.weight": ("mlp.gate.weight", -1),
    "feed_forward.experts.w1": ("mlp.experts.gate_up_proj", 0),
    "feed_forward.experts.w3": ("mlp.experts.gate_up_proj", 1),
    "feed_forward.experts.w2": ("mlp.experts.down_proj", -1),
}
FUSED_MARK = "mlp.experts.gate_up_proj"
"""A checkpoint whose first MoE layer holds this tensor keeps its experts fused."""
EXPERT_BIAS = "feed_forward.router.expert_bias"


@dataclass(frozen=True)
class HfTensor:
    """Where an isthmus tensor lives in an HF checkpoint, and how its rows are laid out there."""

    name: str
    rope_heads: int = 0
    """Heads whose rows are permuted between the two rotary layouts (0: stored as is)."""
    experts: int = 0
    """> 0: the isthmus tensor stacks this many HF tensors along a new first dimension, expert e's
    named ``name.format(e=e)``."""

    half: int = -1
    """0 or 1: the isthmus tensor is that half of dimension 1 of a fused [n_experts, 2 ffn, dim] tensor
    (gate rows, then up rows); -1: all of it."""

    def names(self) -> list[str]:
        """The HF tensors it is made of, in order."""
        return [self.name.format(e=e) for e in range(self.experts)] if self.experts else [self.name]


def hf_name_map(args: ModelArgs, fused: bool = False) -> dict[str, HfTensor]:
    """Every tensor of the isthmus model that HF stores, by canonical name, with its HF counterpart
    (``fused``: the experts under transformers 5's in-memory names, see the module's docstring).

    A tied head is the embedding: ``output.weight`` is absent (HF stores no ``lm_head.weight`` then).
    So are the routers' expert biases (`hf_zero_names`).
    """
    moe_names = _MIXTRAL_MOE_NAMES if args.is_moe and hf_arch_for(args) is MIXTRAL else _QWEN3_MOE_NAMES
    names = {"tok_embeddings.weight": HfTensor(_EMBED), "norm.weight": HfTensor("model.norm.weight")}
    if not args.tie_embeddings:
        names["output.weight"] = HfTensor("lm_head.weight")
    rope_heads = {
        "attention.wq.weight": args.n_heads,
        "attention.wk.weight": args.n_kv_heads,
        "attention.q_norm.weight": 1,
        "attention.k_norm.weight": 1,
    }
    for i in range(args.n_layers):
        block = {**_ATTENTION_NAMES, **(_QK_NORM_NAMES if args.qk_norm else {})}
        block.update(moe_names if args.moe_layer(i) else _MLP_NAMES)
        for ours, theirs in block.items():
            experts = args.n_experts if ours.startswith("feed_forward.experts.") else 0
            if fused and ours in _FUSED_MOE_NAMES:
                name, half = _FUSED_MOE_NAMES[ours]
                names[f"layers.{i}.{ours}"] = HfTensor(f"model.layers.{i}.{name}", half=half)
                continue
            names[f"layers.{i}.{ours}"] = HfTensor(f"model.layers.{i}.{theirs}", rope_heads.get(ours, 0), experts)
    return names


def hf_zero_names(args: ModelArgs) -> list[str]:
    """The isthmus tensors HF checkpoints lack because they are zeros there: the routers' expert biases."""
    return [f"layers.{i}.{EXPERT_BIAS}" for i in range(args.n_layers) if args.moe_layer(i)]


def to_hf_rows(w: Tensor, n_heads: int) -> Tensor:
    """Adjacent-pair rotary rows (isthmus, Meta) -> half-split rows (HF), per head; rows are the first
    dimension (a 1-D norm scale is a column)."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.view(n_heads, rows // n_heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def from_hf_rows(w: Tensor, n_heads: int) -> Tensor:
    """Half-split rotary rows (HF) -> adjacent-pair rows (isthmus, Meta): the inverse of `to_hf_rows`."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.view(n_heads, 2, rows // n_heads // 2, *rest).transpose(1, 2).reshape(w.shape)


def hf_state_dict(state: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """An isthmus state dict (canonical names) under HF names and rotary layout, contiguous; stacked
    experts are split into one tensor per expert."""
    out = {}
    for ours, where in hf_name_map(args).items():
        w = state[ours]
        if where.experts:
            out.update({name: w[e].contiguous() for e, name in enumerate(where.names())})
            continue
        out[where.name] = (to_hf_rows(w, where.rope_heads) if where.rope_heads else w).contiguous()
    return out
