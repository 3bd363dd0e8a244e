"""Shape of a decoder-only transformer: the one description the model, FLOP counts and planner share."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from isthmus.errors import ConfigError

MlpKind = Literal["swiglu", "gelu"]
RouterScore = Literal["softmax", "sigmoid"]
LoadBalance = Literal["aux_loss", "bias", "none"]


@dataclass(frozen=True)
class ModelArgs:
    """Hyper-parameters of a Llama-style decoder (GPT-style when ``mlp == "gelu"``)."""

    dim: int
    """Hidden size h."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Attention (query) heads; head_dim = dim // n_heads unless attn_head_dim says otherwise."""
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
    n_experts: int = 0
    """Routed experts per Mixture-of-Experts layer; 0 = a dense model."""
    top_k: int = 2
    """Routed experts each token goes to."""
    moe_ffn_dim: int = 0
    """Hidden size of each routed (and each shared) expert's SwiGLU; 0 = ffn_dim."""
    n_shared_experts: int = 0
    """Always-on experts, run as one SwiGLU of width n_shared_experts * expert_ffn_dim."""
    n_dense_layers: int = 0
    """The first blocks keep the dense MLP (DeepSeek's first_k_dense_replace)."""
    router_score: RouterScore = "softmax"
    """Score function of the router over the experts' logits: softmax or sigmoid."""
    router_norm_topk: bool = True
    """Renormalise each token's top-k scores to sum to 1."""
    capacity_factor: float = 0.0
    """0 = dropless; > 0: an expert takes at most ceil(cf * tokens * top_k / n_experts) of the tokens a rank
    routes, the rest are dropped (their routed output is 0, the residual passes)."""
    load_balance: LoadBalance = "aux_loss"
    """aux_loss (Switch/GShard auxiliary loss), bias (arXiv 2408.15664: a per-expert bias on the selection
    scores, moved after each step towards equal load) or none."""
    aux_loss_coef: float = 0.01
    """Weight of the auxiliary load-balancing loss in the training loss."""
    bias_update_rate: float = 0.001
    """Step of the bias method's update: bias_e += rate * sign(mean load - load_e)."""
    attn_head_dim: int = 0
    """Width of each attention head when it is not dim // n_heads (Qwen3: 128 at dim 2048, 32 heads); 0 = dim //
    n_heads. The field is not named head_dim because `head_dim` is the resolved width every user reads."""
    qk_norm: bool = False
    """RMSNorm each query and key head (a learned scale of head_dim) before RoPE, as Qwen3 does."""

    @property
    def head_dim(self) -> int:
        """Width of each attention head: attn_head_dim, or dim // n_heads."""
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def is_moe(self) -> bool:
        """Whether some blocks route tokens to experts."""
        return self.n_experts > 0

    @property
    def expert_ffn_dim(self) -> int:
        """Hidden size of one routed or shared expert."""
        return self.moe_ffn_dim or self.ffn_dim

    @property
    def n_moe_layers(self) -> int:
        """Blocks whose feed-forward is a Mixture-of-Experts layer."""
        return self.n_layers - self.n_dense_layers if self.is_moe else 0

    def moe_layer(self, i: int) -> bool:
        """Whether block ``i`` is a Mixture-of-Experts layer."""
        return self.is_moe and i >= self.n_dense_layers

    def with_overrides(self, **kw: Any) -> ModelArgs:
        """A copy with the given fields replaced (None values are ignored)."""
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


def check_args(args: ModelArgs) -> None:
    """Raise ConfigError for shapes the attention layout cannot represent."""
    if args.attn_head_dim < 0:
        raise ConfigError("model.attn_head_dim", args.attn_head_dim, "must be >= 0 (0 = dim // n_heads)")
    if not args.attn_head_dim and args.dim % args.n_heads:
        raise ConfigError("model.n_heads", args.n_heads, f"must divide model.dim = {args.dim}")
    if args.n_heads % args.n_kv_heads:
        raise ConfigError("model.n_kv_heads", args.n_kv_heads, f"must divide model.n_heads = {args.n_heads}")
    if args.attn_head_dim % 2:
        raise ConfigError("model.attn_head_dim", args.attn_head_dim, "must be even for RoPE")
    if args.head_dim % 2:
        raise ConfigError("model.dim", args.dim, f"dim / n_heads = {args.head_dim} must be even for RoPE")
    if args.mlp not in ("swiglu", "gelu"):
        raise ConfigError("model.mlp", args.mlp, "choose one of: swiglu, gelu")
    check_moe_args(args)


def check_moe_args(args: ModelArgs) -> None:
    """Raise ConfigError for Mixture-of-Experts settings that cannot be built (none for a dense model)."""
    if args.n_experts < 0:
        raise ConfigError("model.n_experts", args.n_experts, "must be >= 0 (0 = a dense model)")
    if not args.is_moe:
        return
    if not 1 <= args.top_k <= args.n_experts:
        raise ConfigError("model.top_k", args.top_k, f"must be in [1, model.n_experts = {args.n_experts}]")
    if args.mlp != "swiglu":
        raise ConfigError("model.mlp", args.mlp, "experts are SwiGLU: a model with n_experts > 0 needs mlp = swiglu")
    for key in ("moe_ffn_dim", "n_shared_experts", "n_dense_layers"):
        if getattr(args, key) < 0:
            raise ConfigError(f"model.{key}", getattr(args, key), "must be >= 0")
    if args.n_dense_layers >= args.n_layers:
        raise ConfigError(
            "model.n_dense_layers", args.n_dense_layers, f"must be below model.n_layers = {args.n_layers}"
        )
    if args.router_score not in ("softmax", "sigmoid"):
        raise ConfigError("model.router_score", args.router_score, "choose one of: softmax, sigmoid")
    if args.load_balance not in ("aux_loss", "bias", "none"):
        raise ConfigError("model.load_balance", args.load_balance, "choose one of: aux_loss, bias, none")
    for key in ("capacity_factor", "aux_loss_coef", "bias_update_rate"):
        value = getattr(args, key)
        if not value >= 0:  # also rejects NaN
            raise ConfigError(f"model.{key}", value, "must be >= 0")
