"""A Hugging Face Llama ``config.json`` read as `ModelArgs`, and written from them.

Only what computes the same function as isthmus's decoder is accepted: ``LlamaForCausalLM`` with
SiLU-gated MLPs, no biases, no rope scaling and ``head_dim = hidden_size / num_attention_heads``.
Anything else is refused in one line naming the field, before a tensor is read. Torch-free, so the
planner and preflight can learn a checkpoint's shape cheaply.
"""

from __future__ import annotations

import json
import math
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


def json_positive(value: object, key: str, path: Path) -> float:
    """A positive, finite JSON number (an epsilon, a base)."""
    number = value if isinstance(value, float) else math.nan
    if isinstance(value, int) and not isinstance(value, bool):
        number = float(value) if value < 2**1000 else math.inf  # float() of a larger one overflows
    if not 0 < number < math.inf:
        raise _refuse(path, key, value, "must be a positive number")
    return number


def json_flag(config: dict[str, Any], key: str, path: Path) -> bool:
    """An optional true or false (null: false)."""
    value = config.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _refuse(path, key, value, "must be true or false")
    return value


def _rope_theta(config: dict[str, Any], path: Path) -> float:
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
    return json_positive(config.get("rope_theta", HF_DEFAULT_ROPE_THETA), "rope_theta", path)


def _refuse_variants(config: dict[str, Any], path: Path) -> None:
    model_type = config.get("model_type", "llama")
    if model_type != "llama":
        raise _refuse(path, "model_type", model_type, "isthmus imports llama only")
    architectures = config.get("architectures", [ARCHITECTURE])
    if architectures != [ARCHITECTURE]:
        raise _refuse(path, "architectures", architectures, f"isthmus imports [{ARCHITECTURE!r}] only")
    for key in ("attention_bias", "mlp_bias"):
        if json_flag(config, key, path):
            raise _refuse(path, key, config[key], "isthmus's layers have no biases")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse(path, "hidden_act", act, "isthmus's MLP is SiLU-gated (silu) only")


def args_from_hf_config(config: dict[str, Any], path: Path) -> ModelArgs:
    """The `ModelArgs` of a Llama ``config.json`` (parsed; ``path`` names it in errors).

    Every field isthmus reads is checked here, its type and its range, so a damaged or hostile file
    ends in one line naming the field."""
    _refuse_variants(config, path)
    dim = json_size(config, "hidden_size", path)
    heads = json_size(config, "num_attention_heads", path)
    # transformers reads a missing or null count as "as many as the query heads".
    kv_heads = heads if config.get("num_key_value_heads") is None else json_size(config, "num_key_value_heads", path)
    if config.get("head_dim") is not None:
        head_dim = json_size(config, "head_dim", path)
        if head_dim * heads != dim:
            raise _refuse(
                path, "head_dim", head_dim, f"isthmus needs hidden_size / num_attention_heads = {dim / heads:g}"
            )
    return ModelArgs(
        dim=dim,
        n_layers=json_size(config, "num_hidden_layers", path),
        n_heads=heads,
        n_kv_heads=kv_heads,
        ffn_dim=json_size(config, "intermediate_size", path),
        vocab_size=json_size(config, "vocab_size", path),
        mlp="swiglu",
        tie_embeddings=json_flag(config, "tie_word_embeddings", path),
        norm_eps=json_positive(config.get("rms_norm_eps", HF_DEFAULT_NORM_EPS), "rms_norm_eps", path),
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
