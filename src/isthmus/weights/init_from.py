"""Start a run from saved weights (``model.init_from``): a Hugging Face folder (Llama, Qwen3, Mixtral,
Qwen3-MoE; see `hf_config`) or an isthmus export.

`open_weights` checks the source before the model is built: every tensor the model needs is
present with the right shape and a float dtype (read from the safetensors headers only). Then
`load_weights` fills this rank's parameters, whatever the layout. A rank whose shard is one block
of the full tensor (TP, FSDP, HSDP, EP, and FSDP over TP or EP where it splits evenly) reads only
that block from the file, converted to isthmus's rotary layout and the parameter's dtype; for other
placements (an uneven split of a dimension split twice) it reads the one full tensor and slices it
as DTensor does, one tensor at a time. Stacked experts are read from their per-expert HF
tensors, only the experts (and rows) of the block. Pipeline stages read only their own layers. The
optimizer starts fresh. Only safetensors and JSON are read: no pickle, so the data never runs code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from isthmus.errors import CheckpointError
from isthmus.log import get_logger
from isthmus.models.args import ModelArgs
from isthmus.models.llama import build_model, canonical_name
from isthmus.models.pretrained import hf_weight_files, is_hf_folder, safetensors_header
from isthmus.weights.export import load_exported
from isthmus.weights.hf_names import FUSED_MARK, HfTensor, from_hf_rows, hf_name_map, hf_zero_names

FLOAT_DTYPES = ("F32", "BF16", "F16")


@dataclass
class _Located:
    files: list[Path]
    """The file of each of ``where.names()``."""
    where: HfTensor


Box = tuple[tuple[int, ...], tuple[int, ...]]
"""A block of a tensor: (offset, shape) per dimension."""


class PretrainedWeights:
    """Tensors of a pretrained model by isthmus's canonical name, in isthmus's layout, read one block at a time."""

    def __init__(
        self,
        args: ModelArgs,
        located: dict[str, _Located],
        exported: dict[str, torch.Tensor],
        zeros: frozenset[str] = frozenset(),
    ) -> None:
        self.args = args
        self._shapes = _shapes(args)
        self._located = located
        self._exported = exported
        self._zeros = zeros
        """Tensors the source lacks because they are zeros there (`hf_zero_names`)."""

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor."""
        shape = self._shapes[name]
        return self.block(name, ((0,) * len(shape), shape))

    def block(self, name: str, box: Box) -> torch.Tensor:
        """The block ``box`` of the tensor ``name``; from an HF file only those bytes are read."""
        offset, shape = box
        index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
        if name in self._exported:
            return self._exported[name][index]
        if name in self._zeros:
            return torch.zeros(shape)
        loc = self._located[name]
        if loc.where.half >= 0:  # gate or up rows of a fused [n_experts, 2 ffn, dim] tensor
            rows = loc.where.half * self._shapes[name][1]
            return self._read(loc.files[0], loc.where.name, 0, (offset[0], offset[1] + rows, *offset[2:]), shape)
        if not loc.where.experts:
            return self._read(loc.files[0], loc.where.name, loc.where.rope_heads, offset, shape)
        # Stacked experts: one HF tensor per expert, each cut to the block's other dimensions.
        names, files = loc.where.names(), loc.files
        first = offset[0] if shape[0] else 0  # an empty block still needs a tensor's dtype
        parts = [
            self._read(files[e], names[e], 0, offset[1:], shape[1:]) for e in range(first, first + max(shape[0], 1))
        ]
        return torch.stack(parts)[: shape[0]]

    def _read(
        self, file: Path, hf_name: str, heads: int, offset: tuple[int, ...], shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The block (offset, shape) of one HF tensor, its rows in isthmus's rotary layout."""
        index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
        with safe_open(str(file), framework="pt") as f:
            stored = f.get_slice(hf_name)
            if not heads:
                return stored[index]
            # Permuted rows stay inside their head: read the whole heads the block touches, permute, cut.
            head_rows = self.args.head_dim
            first, last = offset[0] // head_rows, -(-(offset[0] + shape[0]) // head_rows)
            rows = from_hf_rows(stored[(slice(first * head_rows, last * head_rows), *index[1:])], last - first)
            start = offset[0] - first * head_rows
            return rows[start : start + shape[0]]


def _local_box(p: DTensor) -> Box | None:
    """This rank's block of a DTensor when it is one chunk of the full tensor per dimension; None for
    other placements.

    Two cases: each tensor dimension sharded over at most one mesh dimension (TP, FSDP, HSDP, EP), or
    FSDP over another sharding of the same dimension (FSDP over TP, or over EP's experts), whose
    ``_StridedShard`` means: the later mesh dimension splits first, then FSDP splits each of its
    pieces, so an even split leaves each rank one contiguous chunk."""
    offset, shape = [0] * p.dim(), list(p.shape)
    coordinate = p.device_mesh.get_coordinate()
    assert coordinate is not None, "a rank outside the parameter's mesh"
    placements = list(p.placements)
    seen: set[int] = set()
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate) or mesh_dim in seen:
            continue
        d, parts = getattr(placement, "dim", -1), p.device_mesh.size(mesh_dim)
        if isinstance(placement, _StridedShard):
            inner = [m for m, q in enumerate(placements) if m > mesh_dim and type(q) is Shard and q.dim == d]
            if len(inner) != 1 or p.device_mesh.size(inner[0]) != placement.split_factor:
                return None
            outer_parts, index = int(placement.split_factor), coordinate[inner[0]]
            if shape[d] % (parts * outer_parts):
                return None  # an uneven strided split is not one chunk per rank: DTensor slices it
            chunk = shape[d] // (parts * outer_parts)
            offset[d], shape[d] = (index * parts + coordinate[mesh_dim]) * chunk, chunk
            seen.add(inner[0])
            continue
        if type(placement) is not Shard or offset[d] or shape[d] != p.shape[d]:
            return None  # another kind, or a dimension already split
        # DTensor's chunking (torch.chunk): equal chunks of ceil(n / parts), the last ones shorter or empty.
        chunk = -(-shape[d] // parts)
        start = min(chunk * coordinate[mesh_dim], shape[d])
        offset[d], shape[d] = start, min(chunk, shape[d] - start)
    return tuple(offset), tuple(shape)


def _shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor's full shape by canonical name, from a model built on meta (no memory)."""
    return {name: tuple(t.shape) for name, t in build_model(args).state_dict().items()}


def _open_hf(folder: Path, args: ModelArgs) -> PretrainedWeights:
    files = hf_weight_files(folder)
    expected = _shapes(args)
    headers: dict[Path, dict] = {}
    located = {}
    fused = args.is_moe and f"model.layers.{args.n_dense_layers}.{FUSED_MARK}" in files
    for ours, where in hf_name_map(args, fused).items():
        # Each stacked expert is one slice of the isthmus tensor; gate and up share a fused tensor.
        want = expected[ours][1:] if where.experts else expected[ours]
        if where.half >= 0:
            want = (want[0], 2 * want[1], *want[2:])
        found = []
        for name in where.names():
            file = files.get(name)
            if file is None:
                raise CheckpointError(f"{folder}: the tensor {name} is missing")
            if file not in headers:
                headers[file] = safetensors_header(file)
            info = headers[file].get(name) or {}
            shape, dtype = tuple(info.get("shape", ())), info.get("dtype")
            if shape != want:
                raise CheckpointError(f"{file}: {name} has shape {list(shape)}, config.json says {list(want)}")
            if dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"{file}: {name} is {dtype}; only {', '.join(FLOAT_DTYPES)} weights load")
            found.append(file)
        located[ours] = _Located(found, where)
    return PretrainedWeights(args, located, {}, frozenset(hf_zero_names(args)))


def open_weights(init_from: str, args: ModelArgs, key: bytes | None = None) -> PretrainedWeights:
    """The weights ``model.init_from`` names, checked against ``args`` (their own shape, see
    `init_source_args`); given ``key``, an isthmus export must be signed with it."""
    path = Path(init_from)
    if is_hf_folder(path):
        weights = _open_hf(path, args)
    else:
        exported = load_exported(path, key)  # checks its sha256 (and signature) before use
        for name, expected_shape in _shapes(args).items():
            shape = tuple(exported.state[name].shape) if name in exported.state else None
            if shape != expected_shape:
                raise CheckpointError(f"{path}: {name} has shape {shape}, its metadata says {expected_shape}")
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
            if not isinstance(p, DTensor):
                p.copy_(weights.tensor(name))
                continue
            local = p.to_local()
            box = _local_box(p)
            if box is not None and box[1] == tuple(local.shape):
                local.copy_(weights.block(name, box))
                continue
            # Other placements (a dimension sharded twice, strided FSDP-over-TP shards): slice a full
            # copy the way DTensor does; src_data_rank=None: no communication.
            full = weights.tensor(name).to(local.device, p.dtype)
            local.copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
