"""A Hugging Face Llama ``config.json`` read as `ModelArgs`, and written from them.

Only what computes the same function as isthmus's decoder is accepted: ``LlamaForCausalLM`` with
SiLU-gated MLPs, no biases, no rope scaling and ``head_dim = hidden_size / num_attention_heads``.
Anything else is refused in one line naming the field, before a tensor is read. Torch-free, so the
planner and preflight can learn a checkpoint's shape cheaply.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from isthmus.errors import CheckpointError
from isthmus.models.args import ModelArgs

HF_CONFIG_FILE = "config.json"
ARCHITECTURE = "LlamaForCausalLM"
# transformers' defaults for keys a config.json may leave out.
HF_DEFAULT_NORM_EPS = 1e-6
HF_DEFAULT_ROPE_THETA = 10000.0


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


def _rope_theta(config: dict[str, Any], path: Path) -> float:
    """rope_theta at the top level (transformers 4) or in ``rope_parameters`` (transformers 5);
    any scaling (rope_scaling, or a rope_type other than default) is refused."""
    if config.get("rope_scaling"):
        raise CheckpointError(f"{path}: rope_scaling = {config['rope_scaling']!r}: isthmus supports plain RoPE only")
    params = config.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{path}: rope_parameters = {params!r}: must be a JSON object")
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise CheckpointError(
            f"{path}: rope_parameters.rope_type = {rope_type!r}: isthmus supports plain RoPE (default) only"
        )
    return float(params.get("rope_theta", config.get("rope_theta", HF_DEFAULT_ROPE_THETA)))


def _refuse_variants(config: dict[str, Any], path: Path) -> None:
    model_type = config.get("model_type", "llama")
    if model_type != "llama":
        raise CheckpointError(f"{path}: model_type = {model_type!r}: isthmus imports llama only")
    architectures = config.get("architectures", [ARCHITECTURE])
    if architectures != [ARCHITECTURE]:
        raise CheckpointError(f"{path}: architectures = {architectures!r}: isthmus imports [{ARCHITECTURE!r}] only")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise CheckpointError(f"{path}: {key} = {config[key]!r}: isthmus's layers have no biases")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{path}: hidden_act = {act!r}: isthmus's MLP is SiLU-gated (silu) only")


def _field(config: dict[str, Any], key: str, path: Path) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"{path}: {key} = {value!r}: must be a positive integer")
    return value


def args_from_hf_config(config: dict[str, Any], path: Path) -> ModelArgs:
    """The `ModelArgs` of a Llama ``config.json`` (parsed; ``path`` names it in errors)."""
    _refuse_variants(config, path)
    dim = _field(config, "hidden_size", path)
    heads = _field(config, "num_attention_heads", path)
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * heads != dim:
        raise CheckpointError(
            f"{path}: head_dim = {head_dim!r}: isthmus needs hidden_size / num_attention_heads = {dim / heads:g}"
        )
    return ModelArgs(
        dim=dim,
        n_layers=_field(config, "num_hidden_layers", path),
        n_heads=heads,
        n_kv_heads=_field({"num_key_value_heads": kv_heads}, "num_key_value_heads", path),
        ffn_dim=_field(config, "intermediate_size", path),
        vocab_size=_field(config, "vocab_size", path),
        mlp="swiglu",
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        norm_eps=float(config.get("rms_norm_eps", HF_DEFAULT_NORM_EPS)),
        rope_theta=_rope_theta(config, path),
    )


def hf_config_from_args(args: ModelArgs, max_positions: int, dtype: str) -> dict[str, Any]:
    """A ``config.json`` for ``LlamaForCausalLM`` with ``args``'s shape; ``max_positions`` is the
    trained sequence length, ``dtype`` the weights' (``float32``...). rope_theta is written both
    where transformers 4 and 5 read it."""
    if args.mlp != "swiglu":
        raise CheckpointError(f"model.mlp = {args.mlp!r}: only a swiglu model is a LlamaForCausalLM")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.ffn_dim,
        "vocab_size": args.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": max_positions,
        "bos_token_id": None,
        "eos_token_id": None,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
