"""Start a run from saved weights (``model.init_from``): a Hugging Face Llama folder or an isthmus export.

`open_weights` checks the source before the model is built: every tensor the model needs is
present with the right shape and a float dtype (read from the safetensors headers only). Then
`load_weights` fills this rank's parameters, whatever the layout: like `init_weights`, each full
tensor is read on its own, converted to isthmus's layout and the parameter's dtype, and sliced to
this rank's shard (DTensor placements: TP, FSDP), so at most one full tensor is held at a time and
a pipeline stage reads only its own layers. The optimizer starts fresh. Only safetensors and
JSON are read: no pickle, so the data never runs code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from isthmus.errors import CheckpointError
from isthmus.log import get_logger
from isthmus.models.args import ModelArgs
from isthmus.models.hf import HfTensor, from_hf_tensor, hf_name_map
from isthmus.models.llama import canonical_name
from isthmus.models.pretrained import is_hf_folder, safetensors_header
from isthmus.train.export import load_exported

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = ("F32", "BF16", "F16")


@dataclass
class _Located:
    file: Path
    where: HfTensor


class PretrainedWeights:
    """Full tensors of a pretrained model by isthmus's canonical name, in isthmus's layout, read one at a time."""

    def __init__(self, args: ModelArgs, located: dict[str, _Located], exported: dict[str, torch.Tensor]) -> None:
        self.args = args
        self._located = located
        self._exported = exported

    def tensor(self, name: str) -> torch.Tensor:
        if name in self._exported:
            return self._exported[name]
        loc = self._located[name]
        with safe_open(str(loc.file), framework="pt") as f:
            return from_hf_tensor(f.get_tensor(loc.where.name), loc.where)


def _hf_files(folder: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file that holds it (single file or sharded index)."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: folder / file for name, file in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(
            f"{folder}: holds neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors weights are read)"
        )
    return dict.fromkeys(safetensors_header(single), single)


def _expected_shape(name: str, args: ModelArgs) -> tuple[int, ...]:
    """The full shape of a canonical parameter, from the model's shape alone."""
    a, hd = args, args.head_dim
    module = name.split(".")[-2]
    shapes = {
        "tok_embeddings": (a.vocab_size, a.dim),
        "output": (a.vocab_size, a.dim),
        "wq": (a.n_heads * hd, a.dim),
        "wk": (a.n_kv_heads * hd, a.dim),
        "wv": (a.n_kv_heads * hd, a.dim),
        "wo": (a.dim, a.n_heads * hd),
        "w1": (a.ffn_dim, a.dim),
        "w3": (a.ffn_dim, a.dim),
        "w2": (a.dim, a.ffn_dim),
    }
    return shapes.get(module, (a.dim,))


def _open_hf(folder: Path, args: ModelArgs) -> PretrainedWeights:
    files = _hf_files(folder)
    headers: dict[Path, dict] = {}
    located = {}
    for ours, where in hf_name_map(args).items():
        file = files.get(where.name)
        if file is None:
            raise CheckpointError(f"{folder}: the tensor {where.name} is missing")
        if file not in headers:
            headers[file] = safetensors_header(file)
        info = headers[file].get(where.name) or {}
        shape, dtype = tuple(info.get("shape", ())), info.get("dtype")
        if shape != _expected_shape(ours, args):
            raise CheckpointError(
                f"{file}: {where.name} has shape {list(shape)}, config.json says {list(_expected_shape(ours, args))}"
            )
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{file}: {where.name} is {dtype}; only {', '.join(FLOAT_DTYPES)} weights load")
        located[ours] = _Located(file, where)
    return PretrainedWeights(args, located, {})


def open_weights(init_from: str, args: ModelArgs, key: bytes | None = None) -> PretrainedWeights:
    """The weights ``model.init_from`` names, checked against ``args`` (their own shape, see
    `init_source_args`); given ``key``, an isthmus export must be signed with it."""
    path = Path(init_from)
    if is_hf_folder(path):
        weights = _open_hf(path, args)
    else:
        exported = load_exported(path, key)  # checks its sha256 (and signature) before use
        for name in hf_name_map(args):  # the same tensors as an HF folder, by isthmus's names
            shape = tuple(exported.state[name].shape) if name in exported.state else None
            if shape != _expected_shape(name, args):
                raise CheckpointError(
                    f"{path}: {name} has shape {shape}, its metadata says {_expected_shape(name, args)}"
                )
        weights = PretrainedWeights(args, {}, exported.state)
    get_logger().info("initial weights from %s", path)
    return weights


@torch.no_grad()
def load_weights(modules: list[nn.Module], weights: PretrainedWeights) -> None:
    """Copy ``weights`` into this rank's (possibly sharded, wrapped or pipeline-split) model parts."""
    for module in modules:
        for raw_name, p in module.named_parameters():
            name = canonical_name(raw_name)
            if weights.args.tie_embeddings and name == "output.weight":
                # A tied head on a stage without the embedding is still the embedding.
                name = "tok_embeddings.weight"
            full = weights.tensor(name).to(p.dtype)
            if isinstance(p, DTensor):
                local = p.to_local()
                # src_data_rank=None: every rank slices its own copy, no communication.
                shard = distribute_tensor(full.to(local.device), p.device_mesh, p.placements, src_data_rank=None)
                local.copy_(shard.to_local())
            else:
                p.copy_(full)
