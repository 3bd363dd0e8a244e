"""The shape of the weights ``model.init_from`` names, read without torch or a tensor.

Two forms: a Hugging Face folder (``config.json``: Llama, Qwen3, Mixtral, Qwen3-MoE; see `hf_config`) or a file ``isthmus export``
wrote (its shape is in the safetensors header's metadata). The header is read as the safetensors
format defines it (an 8-byte little-endian length, then JSON), so this stays torch-free.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import Field, fields
from pathlib import Path
from typing import Any, get_args

from isthmus.errors import CheckpointError
from isthmus.models.args import LoadBalance, MlpKind, ModelArgs, RouterScore
from isthmus.models.hf_config import (
    HF_CONFIG_FILE,
    MAX_SIZE,
    MIXTRAL,
    args_from_hf_config,
    hf_arch,
    json_flag,
    json_non_negative,
    json_positive,
    json_size,
    read_hf_config,
)

EXPORT_ARGS_KEY = "isthmus.model_args"
# A header larger than this is not a safetensors file worth parsing (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Bytes per element of each dtype the safetensors format names.
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / HF_CONFIG_FILE).is_file()


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file: tensor names, dtypes, shapes, offsets and ``__metadata__``.

    Each entry is checked as the format defines it (a known dtype, sizes, offsets that span exactly
    the tensor's bytes and stay inside the file), so a damaged or hostile header is refused here,
    in one line, rather than by the library that later reads the tensor."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > MAX_HEADER_BYTES:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(f.read(size))
        data_bytes = path.stat().st_size - 8 - size
    except (OSError, struct.error, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a readable safetensors file (its header is not a JSON object)")
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise CheckpointError(f"{path}: __metadata__ must be a JSON object of strings")
        else:
            _check_entry(path, name, entry, data_bytes)
    return header


def _check_entry(path: Path, name: str, entry: Any, data_bytes: int) -> None:
    where = f"{path}: {name}:"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where} must be a JSON object of dtype, shape and data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{where} dtype {dtype!r}: unknown to the safetensors format")
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise CheckpointError(f"{where} shape {shape!r}: must be a list of sizes (integers, 0 or more)")
    if (
        not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets)))
        or offsets[0] > offsets[1]
    ):
        raise CheckpointError(f"{where} data_offsets {offsets!r}: must be [begin, end] with 0 <= begin <= end")
    if offsets[1] > data_bytes:
        raise CheckpointError(
            f"{where} data_offsets {offsets} run past the end of the file (its data holds {data_bytes:,} bytes)"
        )
    need = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != need:
        raise CheckpointError(
            f"{where} data_offsets {offsets} holds {offsets[1] - offsets[0]:,} bytes, and {shape} {dtype} needs {need:,}"
        )


def _is_count(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def hf_weight_files(folder: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file of ``folder`` that holds it (single file or sharded index)."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: weight_map must be a JSON object of tensor name -> file name")
        for name, file in weight_map.items():
            # Shards sit beside the index; a path elsewhere would read files the folder does not hold.
            if not isinstance(file, str) or file in ("", ".", "..") or Path(file).name != file:
                raise CheckpointError(
                    f"{index}: weight_map names {file!r} for {name}: must be a file name inside the folder"
                )
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(
            f"{folder}: holds neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors weights are read)"
        )
    return {name: single for name in safetensors_header(single) if name != "__metadata__"}


def _size_checks(args: ModelArgs, config: dict[str, Any]) -> list[tuple[str, int, str, int, int]]:
    """(tensor, its dimension, the config.json field that sizes it, that size, elements per unit of the
    field) for one tensor of each size a config.json gives."""
    arch = hf_arch(config, Path(HF_CONFIG_FILE))
    checks = [
        ("model.embed_tokens.weight", 0, "vocab_size", args.vocab_size, 1),
        ("model.embed_tokens.weight", 1, "hidden_size", args.dim, 1),
        ("model.layers.0.self_attn.q_proj.weight", 0, "head_dim", args.head_dim, args.n_heads),
        ("model.layers.0.self_attn.k_proj.weight", 0, "num_key_value_heads", args.n_kv_heads, args.head_dim),
    ]
    if not args.moe_layer(0):
        checks.append(("model.layers.0.mlp.gate_proj.weight", 0, "intermediate_size", args.ffn_dim, 1))
    if args.is_moe:
        moe = f"model.layers.{args.n_dense_layers}.{'block_sparse_moe' if arch is MIXTRAL else 'mlp'}"
        experts_key = "num_experts" if "num_experts" in config and arch is not MIXTRAL else "num_local_experts"
        ffn_key = "intermediate_size" if arch is MIXTRAL else "moe_intermediate_size"
        w1 = "w1" if arch is MIXTRAL else "gate_proj"
        checks.append((f"{moe}.gate.weight", 0, experts_key, args.n_experts, 1))
        checks.append((f"{moe}.experts.0.{w1}.weight", 0, ffn_key, args.expert_ffn_dim, 1))
    return checks


def _check_config_against_weights(folder: Path, args: ModelArgs, config: dict[str, Any]) -> None:
    """Refuse a config.json whose sizes the weights beside it do not have, naming the field: the
    memory a shape needs is judged from config.json, so a wrong size there must not reach that."""
    config_path = folder / HF_CONFIG_FILE
    files = hf_weight_files(folder)

    def refuse(field: str, why: str) -> CheckpointError:
        return CheckpointError(f"{config_path}: {field} = {config.get(field)!r}: the weights in {folder} {why}")

    layers = sorted({int(m.group(1)) for name in files if (m := _LAYER.match(name))})
    if len(layers) != args.n_layers:
        held = "no layers" if not layers else f"{len(layers)} layer" + ("s" if len(layers) > 1 else "")
        span = "" if not layers else f" (model.layers.{layers[0]}" + (f" to {layers[-1]})" if len(layers) > 1 else ")")
        raise refuse("num_hidden_layers", f"hold {held}{span}")
    headers: dict[Path, dict[str, Any]] = {}
    for tensor, dim, field, expected, per in _size_checks(args, config):
        if tensor not in files:
            continue  # a missing tensor is named when the weights are opened
        file = files[tensor]
        if file not in headers:
            headers[file] = safetensors_header(file)
        shape = (headers[file].get(tensor) or {}).get("shape", [])
        if len(shape) == 2 and shape[dim] != expected * per:
            raise refuse(field, f"have {shape[dim] // per} ({tensor} is {shape})")


_SIZE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")
_POSITIVE_FIELDS = ("norm_eps", "rope_theta")
_CHOICES = {"mlp": get_args(MlpKind), "router_score": get_args(RouterScore), "load_balance": get_args(LoadBalance)}


def _metadata_field(raw: dict[str, Any], f: Field[Any], where: Path) -> Any:
    """One ModelArgs field of an export's metadata, checked by its type (a missing one takes its default)."""
    if f.name in _SIZE_FIELDS:
        return json_size(raw, f.name, where)
    if f.name not in raw:
        return f.default
    value = raw[f.name]
    if f.name in _CHOICES:
        if value not in _CHOICES[f.name]:
            raise CheckpointError(f"{where}: {f.name} = {value!r}: must be one of {', '.join(_CHOICES[f.name])}")
        return value
    if f.type == "bool":
        return json_flag(raw, f.name, where, default=f.default is True)
    if f.name in _POSITIVE_FIELDS:
        return json_positive(value, f.name, where)
    if f.type == "float":
        return json_non_negative(value, f.name, where)
    if f.type == "int" and isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SIZE:
        return value
    raise CheckpointError(f"{where}: {f.name} = {value!r}: must be an integer in [0, {MAX_SIZE:,}]")


def model_args_from_json(text: str, path: Path) -> ModelArgs:
    """The `ModelArgs` an isthmus export keeps in its metadata, each field checked like a config.json's."""
    where = path.with_name(f"{path.name}: {EXPORT_ARGS_KEY}")
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"{path}: damaged isthmus metadata ({type(e).__name__}: {e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: damaged isthmus metadata ({EXPORT_ARGS_KEY} is not a JSON object)")
    known = {f.name for f in fields(ModelArgs)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise CheckpointError(f"{path}: damaged isthmus metadata ({EXPORT_ARGS_KEY} has unknown fields {unknown})")
    return ModelArgs(**{f.name: _metadata_field(raw, f, where) for f in fields(ModelArgs)})


def init_source_args(init_from: str) -> ModelArgs:
    """The `ModelArgs` of the weights at ``init_from`` (an HF folder or an isthmus export file)."""
    path = Path(init_from)
    if is_hf_folder(path):
        config = read_hf_config(path)
        args = args_from_hf_config(config, path / HF_CONFIG_FILE)
        _check_config_against_weights(path, args, config)
        return args
    if path.is_file():
        metadata = safetensors_header(path).get("__metadata__") or {}
        if EXPORT_ARGS_KEY not in metadata:
            raise CheckpointError(f"{path}: not an isthmus export (no {EXPORT_ARGS_KEY} in its metadata)")
        return model_args_from_json(metadata[EXPORT_ARGS_KEY], path)
    raise CheckpointError(
        f"model.init_from {path}: neither a Hugging Face model folder ({HF_CONFIG_FILE} inside) "
        "nor a file isthmus export wrote"
    )
