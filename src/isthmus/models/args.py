"""Shape of a decoder-only transformer: the one description the model, FLOP counts and planner share."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from isthmus.errors import ConfigError

MlpKind = Literal["swiglu", "gelu"]


@dataclass(frozen=True)
class ModelArgs:
    """Hyper-parameters of a Llama-style decoder (GPT-style when ``mlp == "gelu"``)."""

    dim: int
    """Hidden size h."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Attention (query) heads; head_dim = dim // n_heads."""
    n_kv_heads: int
    """Key/value heads (grouped-query attention); equal to n_heads for multi-head attention."""
    ffn_dim: int
    """Hidden size of the MLP (per branch for SwiGLU)."""
    vocab_size: int
    """Vocabulary size of embedding and output head."""
    mlp: MlpKind = "swiglu"
    """'swiglu' (Llama: w1, w3 gate/up, w2 down) or 'gelu' (GPT: w1 up, w2 down)."""
    tie_embeddings: bool = False
    """Share the token-embedding matrix with the output head."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def with_overrides(self, **kw: Any) -> ModelArgs:
        """A copy with the given fields replaced (None values are ignored)."""
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


def check_args(args: ModelArgs) -> None:
    """Raise ConfigError for shapes the attention layout cannot represent."""
    if args.dim % args.n_heads:
        raise ConfigError("model.n_heads", args.n_heads, f"must divide model.dim = {args.dim}")
    if args.n_heads % args.n_kv_heads:
        raise ConfigError("model.n_kv_heads", args.n_kv_heads, f"must divide model.n_heads = {args.n_heads}")
    if args.head_dim % 2:
        raise ConfigError("model.dim", args.dim, f"dim / n_heads = {args.head_dim} must be even for RoPE")
    if args.mlp not in ("swiglu", "gelu"):
        raise ConfigError("model.mlp", args.mlp, "choose one of: swiglu, gelu")
