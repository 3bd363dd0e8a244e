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
refuses to read one. Pass both to every ``dcp.load`` (`load_kwargs`), or load through `load_data_only`.

What the metadata claims is checked before anything is read (`_check_sizes`): each tensor's chunks
cover it, each chunk's bytes fit the storage recorded for it, and each storage lies inside its
file. So no tensor is allocated larger than the checkpoint's files, and no read runs past their end.
A data file that fails to read anyway (torch's restricted unpickler refusing a global, a damaged
zip) is one line naming that file.
"""

from __future__ import annotations

import math
import pickle
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from isthmus.errors import CheckpointError, IsthmusError, UnsafeCheckpoint

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


def _check_metadata(metadata: Any, source: Path, host_local: bool = False) -> Metadata:
    """What the pickle built must be DCP metadata of tensors whose data lies in this directory
    (``host_local``: the part of it on this host, `isthmus.checkpoint.hostlocal`)."""
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{source}: holds a {type(metadata).__name__}, not DCP metadata")
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise _damaged(source, "its entries or storages are not tables")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise UnsafeCheckpoint(
                f"{source}: entry {key!r} is a {type(entry).__name__}; an isthmus checkpoint holds tensors only"
            )
    for info in metadata.storage_data.values():
        name = info.relative_path if isinstance(info, _StorageInfo) else None
        # A bare file name: the data of a checkpoint lies in its own directory, checksummed by its manifest.
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            raise UnsafeCheckpoint(f"{source}: names data file {name!r}, outside the checkpoint directory")
        if info.transform_descriptors:
            # A transform (decompression, say) would make a read's size unknowable before it runs.
            raise UnsafeCheckpoint(
                f"{source}: data file {name} is read through {info.transform_descriptors!r}; isthmus saves none"
            )
    _check_sizes(metadata, source, host_local)
    return metadata


def _shape(value: Any) -> tuple[int, ...] | None:
    """``value`` as a shape (non-negative ints), or None if it is not one."""
    if not isinstance(value, (tuple, list)):
        return None
    if all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value):
        return tuple(value)
    return None


def _damaged(source: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{source}: {what}; the checkpoint was altered or damaged")


def _check_sizes(metadata: Metadata, source: Path, host_local: bool = False) -> None:
    """Every tensor is covered by chunks whose bytes fit their storages, and every storage lies in its file.

    ``host_local``: a checkpoint in per-host folders, whose metadata here lists only the storages of
    this host's files; a chunk without one is another host's (reading it is refused before any read)."""
    file_bytes: dict[str, int] = {}
    storage: dict[MetadataIndex, int] = {}
    for index, info in metadata.storage_data.items():
        where = f"storage of {getattr(index, 'fqn', index)!r}"
        offset, length = _shape((info.offset, info.length)) or (None, None)
        if not isinstance(index, MetadataIndex) or offset is None or length is None:
            raise _damaged(source, f"{where} is not an (offset, length) in a file")
        name = info.relative_path
        if name not in file_bytes:
            path = source.parent / name
            if not path.is_file():
                raise CheckpointError(f"{source}: names data file {name}, which the checkpoint lacks")
            file_bytes[name] = path.stat().st_size
        if offset + length > file_bytes[name]:
            raise _damaged(
                source,
                f"{where} at bytes {offset:,} to {offset + length:,} lies beyond the end of {name} "
                f"({file_bytes[name]:,} bytes)",
            )
        storage[index] = length
    for key, entry in metadata.state_dict_metadata.items():
        assert isinstance(entry, TensorStorageMetadata), "refused by _check_metadata"
        size = _shape(entry.size)
        properties = entry.properties
        if (
            size is None
            or not isinstance(properties, TensorProperties)
            or not isinstance(properties.dtype, torch.dtype)
        ):
            raise _damaged(source, f"entry {key!r} has no valid shape and dtype")
        if not isinstance(entry.chunks, list):
            raise _damaged(source, f"entry {key!r} lists no chunks")
        covered = 0
        for chunk in entry.chunks:
            offsets = _shape(chunk.offsets) if isinstance(chunk, ChunkStorageMetadata) else None
            sizes = _shape(chunk.sizes) if isinstance(chunk, ChunkStorageMetadata) else None
            if offsets is None or sizes is None or not len(offsets) == len(sizes) == len(size):
                raise _damaged(source, f"entry {key!r} has a chunk that is not a block of its shape {size}")
            if any(o + n > dim for o, n, dim in zip(offsets, sizes, size, strict=True)):
                raise _damaged(source, f"entry {key!r} has a chunk at {offsets} of {sizes}, outside its shape {size}")
            elements = math.prod(sizes)
            stored = storage.get(MetadataIndex(key, offsets))
            if elements and stored is None and not host_local:
                raise _damaged(source, f"entry {key!r} has a chunk at {offsets} that no data file holds")
            if not (stored is None and host_local) and elements * properties.dtype.itemsize > (stored or 0):
                raise _damaged(
                    source,
                    f"entry {key!r} has a chunk of {elements:,} {properties.dtype} elements in a storage of "
                    f"{stored or 0:,} bytes",
                )
            covered += elements
        if math.prod(size) > covered:
            raise _damaged(source, f"entry {key!r} claims shape {size} but its chunks hold {covered:,} elements")


def read_metadata_file(source: Path, stream: Any, host_local: bool = False) -> Metadata:
    """DCP metadata unpickled from ``stream`` (the file ``source``) by `MetadataUnpickler`, then checked."""
    try:
        metadata = MetadataUnpickler(stream, source).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # a damaged pickle raises whatever its opcodes lead to
        first = (str(e).strip().splitlines() or [""])[0]
        raise UnsafeCheckpoint(f"{source}: not readable DCP metadata ({type(e).__name__}: {first})") from None
    return _check_metadata(metadata, source, host_local)


class DataOnlyReader(FileSystemReader):
    """DCP's FileSystemReader, reading ``.metadata`` with `MetadataUnpickler` instead of plain pickle, and
    each data file's failure as one line naming the file. ``host_local``: see `_check_sizes`."""

    def __init__(self, path: str, host_local: bool = False) -> None:
        super().__init__(path)
        self.host_local = host_local

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[Any]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            try:
                super().read_data(replace(plan, items=items), planner).wait()
            except IsthmusError:
                raise
            except pickle.UnpicklingError as e:
                # torch.load(weights_only=True) names the global it refused in its message.
                refused = re.search(r"GLOBAL (\S+)", str(e))
                if refused is not None:
                    raise UnsafeCheckpoint(
                        f"{Path(self.path) / name}: refuses to load {refused.group(1)} (a checkpoint holds data only)"
                    ) from None
                raise CheckpointError(f"{Path(self.path) / name}: not readable tensor data (UnpicklingError)") from None
            except Exception as e:  # torch raises several unrelated types for a damaged file
                raise CheckpointError(f"{Path(self.path) / name}: cannot be read ({_first_line(e)})") from None
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # As FileSystemReader.read_metadata, whose only unpickling step is the one replaced here.
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = read_metadata_file(Path(path), stream, self.host_local)
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


def read_metadata(directory: Path, host_local: bool = False) -> Metadata:
    """The DCP metadata of the checkpoint ``directory``, read by `DataOnlyReader`."""
    return DataOnlyReader(str(directory), host_local).read_metadata()


def load_kwargs(directory: Path, host_local: bool = False) -> dict[str, Any]:
    """The ``storage_reader`` and ``planner`` every ``dcp.load`` of ``directory`` uses."""
    return {"storage_reader": DataOnlyReader(str(directory), host_local), "planner": DataOnlyLoadPlanner()}


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def load_data_only(
    tree: dict[str, Any],
    directory: Path,
    group: dist.ProcessGroup | None = None,
    no_dist: bool = True,
    host_local: bool = False,
) -> None:
    """``dcp.load`` of ``tree`` from ``directory`` in place, with `load_kwargs`; any failure is one line.

    DCP wraps every rank's failure, with its traceback, in a CheckpointException (a BaseException):
    an isthmus error from any rank is raised as it is, an interrupt stays an interrupt, anything else
    becomes a CheckpointError naming the checkpoint.
    """
    try:
        dcp.load(
            tree,
            checkpoint_id=str(directory),
            process_group=group,
            no_dist=no_dist,
            **load_kwargs(directory, host_local),
        )
    except CheckpointException as e:
        errors = [failure[0] for failure in e.failures.values()]
        interrupt = next((err for err in errors if not isinstance(err, Exception)), None)
        if interrupt is not None:
            raise interrupt from None
        ours = [err for err in errors if isinstance(err, IsthmusError)]
        first = next((err for err in ours if isinstance(err, UnsafeCheckpoint)), ours[0] if ours else None)
        if first is not None:
            raise first from None
        raise CheckpointError(f"{directory}: cannot be loaded into this model ({_first_line(errors[0])})") from None
    except IsthmusError:
        raise
    except Exception as e:
        raise CheckpointError(f"{directory}: cannot be loaded into this model ({_first_line(e)})") from None
