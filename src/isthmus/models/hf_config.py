"""A Hugging Face ``config.json`` read as `ModelArgs`, and written from them.

Four architectures compute the same function as isthmus's decoder and are accepted:
``LlamaForCausalLM``, ``Qwen3ForCausalLM`` (per-head RMSNorms on queries and keys), and their
Mixture-of-Experts kin ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM`` (softmax routers, top-k
experts, no shared expert). All with SiLU-gated MLPs, no biases, no sliding window and no rope
scaling. Anything else is refused in one line naming the field, before a tensor is read. Torch-free,
so the planner and preflight can learn a checkpoint's shape cheaply.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isthmus.errors import CheckpointError
from isthmus.models.args import ModelArgs

HF_CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class HfArch:
    """One transformers architecture isthmus reads and writes, with its config class's defaults."""

    model_type: str
    architecture: str
    moe: bool
    """Its blocks route tokens to experts."""
    qk_norm: bool
    """Its attention normalises each query and key head before RoPE."""
    norm_eps: float
    """rms_norm_eps when config.json leaves it out."""
    rope_theta: float
    """rope_theta when config.json leaves it out."""
    head_dim: int | None = None
    """head_dim when config.json leaves it out (None: hidden_size / num_attention_heads)."""


LLAMA = HfArch("llama", "LlamaForCausalLM", moe=False, qk_norm=False, norm_eps=1e-6, rope_theta=10000.0)
QWEN3 = HfArch("qwen3", "Qwen3ForCausalLM", moe=False, qk_norm=True, norm_eps=1e-6, rope_theta=10000.0, head_dim=128)
MIXTRAL = HfArch("mixtral", "MixtralForCausalLM", moe=True, qk_norm=False, norm_eps=1e-5, rope_theta=1e6)
QWEN3_MOE = HfArch("qwen3_moe", "Qwen3MoeForCausalLM", moe=True, qk_norm=True, norm_eps=1e-6, rope_theta=10000.0)
HF_ARCHS = {arch.model_type: arch for arch in (LLAMA, QWEN3, MIXTRAL, QWEN3_MOE)}
ARCHITECTURE = LLAMA.architecture
# transformers' defaults for keys a Llama config.json may leave out.
HF_DEFAULT_NORM_EPS = LLAMA.norm_eps
HF_DEFAULT_ROPE_THETA = LLAMA.rope_theta
HF_DEFAULT_AUX_LOSS_COEF = 0.001
"""router_aux_loss_coef when a MoE config.json leaves it out (Mixtral's and Qwen3-MoE's default)."""


def read_hf_config(folder: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of ``folder`` (plain JSON: reading it never runs code)."""
    path = folder / HF_CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; a Hugging Face model folder holds config.json") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return config


MAX_SIZE = 2**31 - 1
"""Largest size a config.json may give: JSON integers have no limit, and products of sizes past this
overflow the planner's and torch's size arithmetic long before memory would refuse them."""


def _refuse(path: Path, key: str, value: object, rule: str) -> CheckpointError:
    return CheckpointError(f"{path}: {key} = {value!r}: {rule}")


def json_size(config: dict[str, Any], key: str, path: Path) -> int:
    """A required size: a JSON integer in 1..MAX_SIZE."""
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SIZE:
        raise _refuse(path, key, value, f"must be a positive integer up to {MAX_SIZE:,}")
    return value


def _json_number(value: object) -> float:
    number = value if isinstance(value, float) else math.nan
    if isinstance(value, int) and not isinstance(value, bool):
        number = float(value) if value < 2**1000 else math.inf  # float() of a larger one overflows
    return number


def json_positive(value: object, key: str, path: Path) -> float:
    """A positive, finite JSON number (an epsilon, a base)."""
    if not 0 < _json_number(value) < math.inf:
        raise _refuse(path, key, value, "must be a positive number")
    return _json_number(value)


def json_non_negative(value: object, key: str, path: Path) -> float:
    """A finite JSON number >= 0 (a loss weight)."""
    if not 0 <= _json_number(value) < math.inf:
        raise _refuse(path, key, value, "must be a number >= 0")
    return _json_number(value)


def json_flag(config: dict[str, Any], key: str, path: Path, default: bool = False) -> bool:
    """An optional true or false (missing or null: ``default``)."""
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _refuse(path, key, value, "must be true or false")
    return value


def _rope_theta(config: dict[str, Any], path: Path, default: float) -> float:
    """rope_theta at the top level (transformers 4) or in ``rope_parameters`` (transformers 5);
    any scaling (rope_scaling, or a rope_type other than default) is refused."""
    if config.get("rope_scaling"):
        raise _refuse(path, "rope_scaling", config["rope_scaling"], "isthmus supports plain RoPE only")
    params = config.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise _refuse(path, "rope_parameters", params, "must be a JSON object")
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise _refuse(path, "rope_parameters.rope_type", rope_type, "isthmus supports plain RoPE (default) only")
    if "rope_theta" in params:
        return json_positive(params["rope_theta"], "rope_parameters.rope_theta", path)
    return json_positive(config.get("rope_theta", default), "rope_theta", path)


def hf_arch(config: dict[str, Any], path: Path) -> HfArch:
    """The architecture a config.json names (``model_type`` and ``architectures``), if isthmus reads it."""
    model_type = config.get("model_type", LLAMA.model_type)
    arch = HF_ARCHS.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        raise _refuse(path, "model_type", model_type, f"isthmus imports {', '.join(HF_ARCHS)} only")
    architectures = config.get("architectures", [arch.architecture])
    if architectures != [arch.architecture]:
        raise _refuse(path, "architectures", architectures, f"isthmus imports [{arch.architecture!r}] only")
    return arch


def _refuse_variants(config: dict[str, Any], arch: HfArch, path: Path) -> None:
    for key in ("attention_bias", "mlp_bias"):
        if json_flag(config, key, path):
            raise _refuse(path, key, config[key], "isthmus's layers have no biases")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse(path, "hidden_act", act, "isthmus's MLP is SiLU-gated (silu) only")
    if json_flag(config, "use_sliding_window", path):
        raise _refuse(path, "use_sliding_window", True, "isthmus attends to every earlier position")
    # Mixtral has no use_sliding_window switch: a window there is its sliding_window.
    if arch is MIXTRAL and config.get("sliding_window") is not None:
        raise _refuse(path, "sliding_window", config["sliding_window"], "isthmus attends to every earlier position")


def _head_dim(config: dict[str, Any], arch: HfArch, dim: int, heads: int, path: Path) -> int:
    """The attention head width as an `ModelArgs.attn_head_dim` (0: hidden_size / num_attention_heads)."""
    if config.get("head_dim") is not None:
        head_dim = json_size(config, "head_dim", path)
    else:
        head_dim = arch.head_dim or 0
    if head_dim % 2:
        raise _refuse(path, "head_dim", head_dim, "must be even for RoPE")
    return 0 if head_dim * heads == dim else head_dim


def _dense_layers(config: dict[str, Any], path: Path, n_layers: int) -> int:
    """Qwen3-MoE's dense blocks (``mlp_only_layers``, ``decoder_sparse_step``) as isthmus's
    `n_dense_layers`: only a run of first blocks is representable."""
    step = config.get("decoder_sparse_step", 1)
    if step != 1:
        raise _refuse(
            path, "decoder_sparse_step", step, "isthmus's MoE blocks are every block after the dense first ones (1)"
        )
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or dense != list(range(len(dense))) or len(dense) >= n_layers:
        raise _refuse(
            path,
            "mlp_only_layers",
            dense,
            f"isthmus keeps dense MLPs only in a run of first blocks, [0, 1, ..., k-1] with k < {n_layers}",
        )
    return len(dense)


def _moe_fields(config: dict[str, Any], arch: HfArch, path: Path, n_layers: int) -> dict[str, Any]:
    # Qwen3-MoE's config.json names the count num_experts; transformers 5 writes it as num_local_experts.
    experts_key = "num_local_experts" if arch is MIXTRAL or "num_experts" not in config else "num_experts"
    n_experts = json_size(config, experts_key, path)
    top_k = json_size(config, "num_experts_per_tok", path)
    if top_k > n_experts:
        raise _refuse(path, "num_experts_per_tok", top_k, f"must be at most {experts_key} = {n_experts}")
    coef = json_non_negative(config.get("router_aux_loss_coef", HF_DEFAULT_AUX_LOSS_COEF), "router_aux_loss_coef", path)
    fields: dict[str, Any] = {"n_experts": n_experts, "top_k": top_k, "aux_loss_coef": coef}
    if arch is MIXTRAL:  # every block is MoE, experts as wide as intermediate_size, top-k renormalised
        return {**fields, "router_norm_topk": True}
    return {
        **fields,
        "moe_ffn_dim": json_size(config, "moe_intermediate_size", path),
        "router_norm_topk": json_flag(config, "norm_topk_prob", path),
        "n_dense_layers": _dense_layers(config, path, n_layers),
    }


def args_from_hf_config(config: dict[str, Any], path: Path) -> ModelArgs:
    """The `ModelArgs` of a ``config.json`` (parsed; ``path`` names it in errors).

    Every field isthmus reads is checked here, its type and its range, so a damaged or hostile file
    ends in one line naming the field."""
    arch = hf_arch(config, path)
    _refuse_variants(config, arch, path)
    dim = json_size(config, "hidden_size", path)
    heads = json_size(config, "num_attention_heads", path)
    n_layers = json_size(config, "num_hidden_layers", path)
    # transformers reads a missing or null count as "as many as the query heads".
    kv_heads = heads if config.get("num_key_value_heads") is None else json_size(config, "num_key_value_heads", path)
    head_dim = _head_dim(config, arch, dim, heads, path)
    if not head_dim and dim % heads:
        raise _refuse(path, "num_attention_heads", heads, f"must divide hidden_size = {dim} when head_dim is unset")
    if heads % kv_heads:
        raise _refuse(path, "num_key_value_heads", kv_heads, f"must divide num_attention_heads = {heads}")
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=kv_heads,
        ffn_dim=json_size(config, "intermediate_size", path),
        vocab_size=json_size(config, "vocab_size", path),
        mlp="swiglu",
        tie_embeddings=json_flag(config, "tie_word_embeddings", path),
        norm_eps=json_positive(config.get("rms_norm_eps", arch.norm_eps), "rms_norm_eps", path),
        rope_theta=_rope_theta(config, path, arch.rope_theta),
        attn_head_dim=head_dim,
        qk_norm=arch.qk_norm,
        **(_moe_fields(config, arch, path, n_layers) if arch.moe else {}),
    )


def hf_arch_for(args: ModelArgs) -> HfArch:
    """The transformers architecture that computes what a model of ``args`` computes; a CheckpointError
    names the first setting none of them has."""
    if args.mlp != "swiglu":
        raise CheckpointError(f"model.mlp = {args.mlp!r}: only a swiglu model is a {LLAMA.architecture}")
    if not args.is_moe:
        return QWEN3 if args.qk_norm else LLAMA
    arch = QWEN3_MOE if args.qk_norm else MIXTRAL

    def refuse(key: str, value: object, rule: str) -> CheckpointError:
        return CheckpointError(f"model.{key} = {value!r}: {rule} (exporting as {arch.architecture})")

    if args.n_shared_experts:
        raise refuse("n_shared_experts", args.n_shared_experts, "Mixtral and Qwen3-MoE have no shared experts")
    if args.router_score != "softmax":
        raise refuse("router_score", args.router_score, "Mixtral's and Qwen3-MoE's routers are softmax")
    if args.load_balance == "bias":
        raise refuse("load_balance", args.load_balance, "the expert bias moves the routing, and HF's routers have none")
    if arch is MIXTRAL and args.n_dense_layers:
        raise refuse(
            "n_dense_layers", args.n_dense_layers, "every Mixtral block is MoE (qk_norm = true makes it Qwen3-MoE)"
        )
    if arch is MIXTRAL and not args.router_norm_topk:
        raise refuse(
            "router_norm_topk", False, "Mixtral renormalises the top-k weights (qk_norm = true makes it Qwen3-MoE)"
        )
    return arch


def hf_config_from_args(args: ModelArgs, max_positions: int, dtype: str) -> dict[str, Any]:
    """A ``config.json`` for the architecture of `hf_arch_for` with ``args``'s shape; ``max_positions``
    is the trained sequence length, ``dtype`` the weights' (``float32``...). rope_theta is written both
    where transformers 4 and 5 read it."""
    arch = hf_arch_for(args)
    config: dict[str, Any] = {
        "architectures": [arch.architecture],
        "model_type": arch.model_type,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.expert_ffn_dim if arch is MIXTRAL else args.ffn_dim,
        "vocab_size": args.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "tie_word_embeddings": args.tie_embeddings,
        "max_position_embeddings": max_positions,
        "bos_token_id": None,
        "eos_token_id": None,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if arch is LLAMA:
        config.update(attention_bias=False, mlp_bias=False)
    if arch in (QWEN3, QWEN3_MOE):
        config.update(attention_bias=False, use_sliding_window=False, sliding_window=None)
    if arch.moe:
        config.update(
            num_experts_per_tok=args.top_k,
            router_aux_loss_coef=args.aux_loss_coef,
            output_router_logits=False,
        )
    if arch is MIXTRAL:
        config.update(num_local_experts=args.n_experts, router_jitter_noise=0.0, sliding_window=None)
    if arch is QWEN3_MOE:
        config.update(
            num_experts=args.n_experts,
            moe_intermediate_size=args.expert_ffn_dim,
            norm_topk_prob=args.router_norm_topk,
            decoder_sparse_step=1,
            mlp_only_layers=list(range(args.n_dense_layers)),
        )
    return config
