"""Hugging Face Llama tensor names and rotary layout <-> isthmus's.

isthmus rotates adjacent pairs (x[2i], x[2i+1]) as Meta's original Llama does; transformers'
Llama rotates halves (x[i], x[i + head_dim/2]). The two compute the same function once the rows
of wq and wk are permuted within each head. ``to_hf_rows`` is the permutation transformers'
``convert_llama_weights_to_hf.py`` applies to Meta weights; ``from_hf_rows`` is its inverse.
Both are pure index moves, so a round trip is bit-exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from isthmus.models.args import ModelArgs

_EMBED = "model.embed_tokens.weight"
# Per block: isthmus's name after "layers.{i}." -> HF's after "model.layers.{i}.".
_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


@dataclass(frozen=True)
class HfTensor:
    """Where an isthmus tensor lives in an HF checkpoint, and how its rows are laid out there."""

    name: str
    rope_heads: int = 0
    """Heads whose rows are permuted between the two rotary layouts (0: stored as is)."""


def hf_name_map(args: ModelArgs) -> dict[str, HfTensor]:
    """Every tensor of the isthmus model, by canonical name, with its HF counterpart.

    A tied head is the embedding: ``output.weight`` is absent (HF stores no ``lm_head.weight`` then).
    """
    names = {"tok_embeddings.weight": HfTensor(_EMBED), "norm.weight": HfTensor("model.norm.weight")}
    if not args.tie_embeddings:
        names["output.weight"] = HfTensor("lm_head.weight")
    for i in range(args.n_layers):
        for ours, theirs in _BLOCK_NAMES.items():
            heads = {"attention.wq.weight": args.n_heads, "attention.wk.weight": args.n_kv_heads}.get(ours, 0)
            names[f"layers.{i}.{ours}"] = HfTensor(f"model.layers.{i}.{theirs}", heads)
    return names


def to_hf_rows(w: Tensor, n_heads: int) -> Tensor:
    """Adjacent-pair rotary rows (isthmus, Meta) -> half-split rows (HF), per head."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def from_hf_rows(w: Tensor, n_heads: int) -> Tensor:
    """Half-split rotary rows (HF) -> adjacent-pair rows (isthmus, Meta): the inverse of `to_hf_rows`."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_state_dict(state: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """An isthmus state dict (canonical names) under HF names and rotary layout, contiguous."""
    out = {}
    for ours, where in hf_name_map(args).items():
        w = state[ours]
        out[where.name] = (to_hf_rows(w, where.rope_heads) if where.rope_heads else w).contiguous()
    return out
