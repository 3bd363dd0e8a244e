"""The shape of the weights ``model.init_from`` names, read without torch or a tensor.

Two forms: a Hugging Face Llama folder (``config.json``, see `hf_config`) or a file ``isthmus export``
wrote (its shape is in the safetensors header's metadata). The header is read as the safetensors
format defines it (an 8-byte little-endian length, then JSON), so this stays torch-free.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from isthmus.errors import CheckpointError
from isthmus.models.args import ModelArgs
from isthmus.models.hf_config import HF_CONFIG_FILE, args_from_hf_config, read_hf_config

EXPORT_ARGS_KEY = "isthmus.model_args"
# A header larger than this is not a safetensors file worth parsing (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / HF_CONFIG_FILE).is_file()


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file: tensor names, dtypes, shapes, offsets and ``__metadata__``."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > MAX_HEADER_BYTES:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, struct.error, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a readable safetensors file (its header is not a JSON object)")
    return header


def init_source_args(init_from: str) -> ModelArgs:
    """The `ModelArgs` of the weights at ``init_from`` (an HF folder or an isthmus export file)."""
    path = Path(init_from)
    if is_hf_folder(path):
        return args_from_hf_config(read_hf_config(path), path / HF_CONFIG_FILE)
    if path.is_file():
        metadata = safetensors_header(path).get("__metadata__") or {}
        if EXPORT_ARGS_KEY not in metadata:
            raise CheckpointError(f"{path}: not an isthmus export (no {EXPORT_ARGS_KEY} in its metadata)")
        try:
            return ModelArgs(**json.loads(metadata[EXPORT_ARGS_KEY]))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: damaged isthmus metadata ({type(e).__name__}: {e})") from None
    raise CheckpointError(
        f"model.init_from {path}: neither a Hugging Face model folder ({HF_CONFIG_FILE} inside) "
        "nor a file isthmus export wrote"
    )
