"""Reading DCP checkpoints without running code: a restricted unpickler for DCP's ``.metadata``.

torch.distributed.checkpoint (DCP) pickles its ``.metadata`` file and its ``FileSystemReader``
reads it back with plain ``pickle.load``, so a crafted file would run any code it names when a
checkpoint is loaded, before a single tensor is read. `DataOnlyReader` is DCP's own reader with
that one read replaced by `MetadataUnpickler`, which admits only the globals an isthmus
checkpoint's metadata holds (listed in `ADMITTED`) and refuses anything else with one line.

The rest of DCP's load path: tensors in the ``.distcp`` files are read with
``torch.load(weights_only=True)``, torch's own restricted unpickler. A "bytes" entry (a Python
object DCP pickles whole) would be read with ``weights_only=False``; isthmus never saves one, so
the metadata may not describe one (`BytesStorageMetadata` is not admitted) and `DataOnlyLoadPlanner`
refuses to read one. Pass both to every ``dcp.load`` (`load_kwargs`).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from isthmus.errors import UnsafeCheckpoint

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
ADMITTED: frozenset[tuple[str, str]] = frozenset(
    {
        # What DCP's .metadata of isthmus checkpoints names, found by saving one under every layout
        # (one process, async, bf16, DDP, ZeRO-1, ZeRO-3, tp 2 with sequence parallel, pp 2, cp 2,
        # dp_shard 2 x tp 2, and geo.sync diloco / streaming_diloco / compressed) and recording the
        # unpickler's find_class calls. Torch dtypes come on top (see `_is_dtype`).
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # torch.layout's reducer: a lookup in torch's own table
        # StorageMeta.checkpoint_id is the directory as a Path; Python 3.13 names the class's module
        # pathlib._local. Building a Path touches no file.
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "WindowsPath"),
    }
)
"""(module, name) of every global `MetadataUnpickler` admits besides torch dtypes. Each one builds an
inert value (a dataclass, a Size, a Path, an enum, a layout), so no combination of them runs code."""


def _is_dtype(module: str, name: str) -> bool:
    """``torch.float32`` and its kin: constants of the already-imported torch module, nothing to import."""
    return module == "torch" and "." not in name and isinstance(getattr(torch, name, None), torch.dtype)


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals in `ADMITTED` and torch dtypes.

    Dicts, lists, tuples, strings and numbers need no global. The check happens before any module
    is imported: importing is itself running code.
    """

    def __init__(self, file: Any, source: Path) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ADMITTED or _is_dtype(module, name):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"{self.source}: refuses to load {module}.{name} (a checkpoint holds data only)")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint(f"{self.source}: refuses a persistent reference (a checkpoint holds data only)")


def _check_metadata(metadata: Any, source: Path) -> Metadata:
    """What the pickle built must be DCP metadata of tensors whose data lies in this directory."""
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{source}: holds a {type(metadata).__name__}, not DCP metadata")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise UnsafeCheckpoint(
                f"{source}: entry {key!r} is a {type(entry).__name__}; an isthmus checkpoint holds tensors only"
            )
    for info in (metadata.storage_data or {}).values():
        name = info.relative_path if isinstance(info, _StorageInfo) else None
        # A bare file name: the data of a checkpoint lies in its own directory, checksummed by its manifest.
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            raise UnsafeCheckpoint(f"{source}: names data file {name!r}, outside the checkpoint directory")
    return metadata


def read_metadata_file(source: Path, stream: Any) -> Metadata:
    """DCP metadata unpickled from ``stream`` (the file ``source``) by `MetadataUnpickler`, then checked."""
    try:
        metadata = MetadataUnpickler(stream, source).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # a damaged pickle raises whatever its opcodes lead to
        first = (str(e).strip().splitlines() or [""])[0]
        raise UnsafeCheckpoint(f"{source}: not readable DCP metadata ({type(e).__name__}: {first})") from None
    return _check_metadata(metadata, source)


class DataOnlyReader(FileSystemReader):
    """DCP's FileSystemReader, reading ``.metadata`` with `MetadataUnpickler` instead of plain pickle."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # As FileSystemReader.read_metadata, whose only unpickling step is the one replaced here.
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = read_metadata_file(Path(path), stream)
        storage = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage.load_id = self.load_id
        metadata.storage_meta = storage
        return metadata


class DataOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, minus its one unrestricted unpickling (``torch.load`` of a bytes entry)."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise UnsafeCheckpoint(
            f"checkpoint entry {read_item.dest_index.fqn!r} is pickled Python bytes; refused (a checkpoint holds data only)"
        )


def read_metadata(directory: Path) -> Metadata:
    """The DCP metadata of the checkpoint ``directory``, read by `DataOnlyReader`."""
    return DataOnlyReader(str(directory)).read_metadata()


def load_kwargs(directory: Path) -> dict[str, Any]:
    """The ``storage_reader`` and ``planner`` every ``dcp.load`` of ``directory`` uses."""
    return {"storage_reader": DataOnlyReader(str(directory)), "planner": DataOnlyLoadPlanner()}
