"""From the `[model]` config section (a flavor plus overrides) to a checked `ModelArgs`."""

from __future__ import annotations

from isthmus.config import DataConfig, ModelConfig
from isthmus.errors import ConfigError
from isthmus.models.args import ModelArgs, check_args
from isthmus.models.flavors import get_flavor
from isthmus.models.pretrained import init_source_args

_SHAPE_KEYS = (
    "n_layers",
    "dim",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "vocab_size",
    "mlp",
    "tie_embeddings",
    "norm_eps",
    "rope_theta",
    "n_experts",
    "top_k",
    "moe_ffn_dim",
    "n_shared_experts",
    "n_dense_layers",
    "router_score",
    "router_norm_topk",
    "capacity_factor",
    "load_balance",
    "aux_loss_coef",
    "bias_update_rate",
    "attn_head_dim",
    "qk_norm",
)
_ROUTING_KEYS = ("capacity_factor", "load_balance", "aux_loss_coef", "bias_update_rate")
"""Shape keys that are training choices, not part of the weights: model.init_from takes them too."""


def resolve_model_args(cfg: ModelConfig, tokenizer_vocab: int | None = None) -> ModelArgs:
    """The flavor's shape with the config's overrides applied, checked for consistency.

    With ``model.init_from`` the shape is the weights' own (see `init_source_args`) and no override
    may be set. For training, ``tokenizer_vocab`` is the data's vocabulary: without an explicit
    ``model.vocab_size`` the model's vocabulary follows the tokenizer (a flavor's own vocabulary
    is what it was published with; the tokenizer decides what the data needs).
    """
    overrides = {k: getattr(cfg, k) for k in _SHAPE_KEYS}
    if cfg.init_from:
        # The weights decide the shape: an override would make them not fit.
        for key, value in overrides.items():
            if value is not None and key not in _ROUTING_KEYS:
                raise ConfigError(f"model.{key}", value, "is set by model.init_from's weights; leave it unset")
        args = init_source_args(cfg.init_from).with_overrides(**{k: overrides[k] for k in _ROUTING_KEYS})
    else:
        if tokenizer_vocab is not None and cfg.vocab_size is None:
            overrides["vocab_size"] = tokenizer_vocab
        args = get_flavor(cfg.flavor).with_overrides(**overrides)
    check_args(args)
    if tokenizer_vocab is not None and args.vocab_size < tokenizer_vocab and cfg.init_from:
        raise ConfigError(
            "model.init_from",
            cfg.init_from,
            f"its vocabulary ({args.vocab_size}) is smaller than the tokenizer's ({tokenizer_vocab})",
        )
    if tokenizer_vocab is not None and args.vocab_size < tokenizer_vocab:
        raise ConfigError(
            "model.vocab_size", args.vocab_size, f"must be at least the tokenizer's vocabulary ({tokenizer_vocab})"
        )
    return args


def expected_vocab(data: DataConfig) -> int | None:
    """The tokenizer vocabulary known before reading the data (None for a pre-tokenised file, whose ids decide it,
    and for a checkpoint's tokenizer, which preflight reads)."""
    if data.format == "bin" or (data.format == "auto" and data.path.endswith(".bin")):
        return None
    if data.tokenizer.startswith("hf:"):
        return None
    return 256 if data.tokenizer == "byte" else data.bpe_vocab_size
