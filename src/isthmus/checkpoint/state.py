"""Resumable training checkpoints with torch.distributed.checkpoint (DCP), loadable under any layout.

What goes where:
- DCP files (every rank writes its own): ``model.<fqn>`` (parameters), ``optim.<fqn>.<name>``
  (the optimizer's per-parameter state, e.g. AdamW's step / exp_avg / exp_avg_sq) and
  ``rng.rank<r>`` (each rank's RNG states). Keys are canonical full-model names, so a tensor is
  found by name whatever layout saved or loads it: DTensors (FSDP2, TP) reshard on load, pipeline
  stages ask only for their own layers, plain tensors (DDP, one process) are read whole.
- Under ``geo.sync``: ``geo.rank<r>.*``, each rank's strategy state (error-feedback residuals,
  DiLoCo's global snapshot, outer momentum and transfers in flight: `GeoSync.state_dict`), its
  tensors as data and its structure as JSON bytes. DiLoCo's datacenters train apart between outer
  steps, so datacenter d > 0 keeps its own model and inner-optimizer state under ``dc<d>.model.*``
  and ``dc<d>.optim.*``; datacenter 0's are the plain ``model.*`` / ``optim.*`` any run loads.
  A geo run resumes its geo state only under the layout that saved it.
- ``isthmus.json`` (rank 0; see `checkpoint_manifest`): step, model shape, layout, config, the
  data-loader position and the LR-scheduler state, and checksums of every file (signed with
  ``checkpoint.key_file`` when one is set).

Loading runs no code a checkpoint could bring: every DCP read goes through `checkpoint_reader`
(DCP's reader with a restricted unpickler for ``.metadata``), and nothing else here unpickles.
Nothing a checkpoint holds ends in a traceback either: its metadata is checked against this
model's tensors before any is read, and its RNG, geo, sampler and scheduler states, which another
hand may have written, are refused in one line when they do not read back.

The optimizer state is keyed by parameter name here rather than through DCP's
``get_optimizer_state_dict``: that helper maps one optimizer to one module, while a pipeline rank
has one optimizer over several stage modules, and it does not know ZeroRedundancyOptimizer. ZeRO-1
(ZeroRedundancyOptimizer, or `ShardedOptimizer` next to tp/pp/cp) keeps each parameter's state on
one rank of its group (its local ``optim``); that rank alone saves it under the parameter's name
(a tensor-parallel shard as a DTensor, each shard by its own owner), so a ZeRO-1 checkpoint is an ordinary checkpoint that any layout loads, and a
ZeRO-1 run loads any checkpoint by asking only for its partition's names.

Commit protocol: all ranks write ``step-N.partial``; DCP returns on rank 0 after every rank's data
and ``.metadata`` are written; rank 0 then checksums the files, writes the manifest and renames the
directory. With ``checkpoint.async_save`` that tail runs in a background thread after DCP's own
background save, on a separate gloo group so it never interleaves with training collectives.
"""

from __future__ import annotations

import base64
import json
import random
import shutil
import socket
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from isthmus.checkpoint.hostlocal import (
    HostFolders,
    HostLocalPlanner,
    HostLocalWriter,
    commit_on_hosts,
    find_host_folders,
    missing_here,
    spans_hosts,
)
from isthmus.checkpoint.manifest import (
    MANIFEST_FILE,
    PARTIAL_SUFFIX,
    Manifest,
    checkpoint_key,
    commit,
    committed_checkpoints,
    find_latest_good,
    prune,
    read_manifest,
    remove_partials,
    step_dir_name,
    verify_checkpoint,
    write_manifest,
)
from isthmus.checkpoint.reader import load_data_only, read_metadata
from isthmus.config import CheckpointConfig, settings_that_differ
from isthmus.data.loader import BatchSampler
from isthmus.errors import CheckpointError, IsthmusError, RunFailed, is_no_space, no_space
from isthmus.log import get_logger
from isthmus.models.args import ModelArgs
from isthmus.models.llama import canonical_name

StateTree = dict[str, Any]


@dataclass
class TrainState:
    """The objects a checkpoint saves and restores (besides the step counter)."""

    modules: list[nn.Module]
    """This rank's model parts (one module, or its pipeline stages)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: BatchSampler
    replica: str = ""
    """Key prefix of this rank's model and optimizer entries: "" where every replica holds the same
    values; "dc<d>" for datacenter d > 0 of a DiLoCo run (its datacenters train apart)."""
    geo: Any = None
    """The `GeoSync` strategy, or None; restored separately by `Checkpointer.load_geo`."""


@dataclass
class ResumePoint:
    """A verified checkpoint to resume from."""

    path: Path
    manifest: Manifest

    @cached_property
    def metadata(self) -> Any:
        """DCP's metadata (read once: `load` and `load_geo` both need it); this host's, for a checkpoint
        in per-host folders."""
        return read_metadata(self.path, self.host_local)

    @property
    def saved(self) -> dict[str, Any]:
        """DCP's metadata of every entry."""
        return cast(dict[str, Any], self.metadata.state_dict_metadata)

    @property
    def host_local(self) -> bool:
        """Saved in per-host folders (`isthmus.checkpoint.hostlocal`)."""
        return bool(self.manifest.hosts)


# --- model and optimizer state, keyed by canonical names -------------------------------------------
def model_state(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's parameters by full-model name (DCP's helper strips DDP and checkpoint-wrapper prefixes)."""

    return {k: cast(torch.Tensor, v) for m in modules for k, v in get_model_state_dict(m).items()}


def _per_group(scheduler: dict[str, Any], groups: int) -> dict[str, Any]:
    """The saved scheduler state with one entry per parameter group of this run's optimizer.

    Every group trains at ``train.lr`` (they differ in weight decay and, under tensor parallelism,
    in tensor kind: see ``train/optim.by_tensor_kind``), so a layout with another number of groups
    takes the first group's values for each of its own."""
    out = dict(scheduler)
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        saved = scheduler.get(key)
        if isinstance(saved, list) and saved and len(saved) != groups:
            out[key] = [saved[0]] * groups
    return out


def _local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: ZeRO-1's local partition, or the optimizer itself."""

    # ``optim``: ZeroRedundancyOptimizer's partition, and isthmus.train.zero1.ShardedOptimizer's (by
    # attribute: checkpoint imports nothing from train).
    local = getattr(optimizer, "optim", None)
    return local if isinstance(local, torch.optim.Optimizer) else optimizer


def _local_params(optimizer: torch.optim.Optimizer, modules: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter this rank's optimizer steps."""
    names = {id(p): canonical_name(n) for m in modules for n, p in m.named_parameters()}
    local = _local_optimizer(optimizer)
    return [(names[id(p)], p) for group in local.param_groups for p in group["params"]]


def optimizer_state(optimizer: torch.optim.Optimizer, modules: list[nn.Module]) -> dict[str, dict[str, torch.Tensor]]:
    """Per-parameter optimizer state by parameter name; under ZeRO-1 only this rank's partition."""
    local = _local_optimizer(optimizer)
    return {name: dict(local.state[p]) for name, p in _local_params(optimizer, modules) if local.state.get(p)}


def _optimizer_targets(
    optimizer: torch.optim.Optimizer, modules: list[nn.Module], saved: dict[str, Any], path: Path, prefix: str = ""
) -> dict[str, dict[str, torch.Tensor]]:
    """Empty tensors, laid out like this rank's parameters, for the optimizer state the checkpoint holds.

    Driven by the checkpoint's metadata, not by the optimizer class: a state entry shaped like its
    parameter is laid out like it (a DTensor for a sharded parameter), a scalar (AdamW's step) is a
    plain tensor. DCP fills them in place.
    """
    by_param: dict[str, dict[str, Any]] = {}
    head = prefix + "optim."
    for key, meta in saved.items():
        if key.startswith(head):
            fqn, _, entry = key[len(head) :].rpartition(".")
            by_param.setdefault(fqn, {})[entry] = meta
    targets: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in _local_params(optimizer, modules):
        entries = by_param.get(name)
        if not entries:
            raise CheckpointError(f"{path}: holds no optimizer state for parameter {name}")
        state = {}
        for entry, meta in entries.items():
            if tuple(meta.size) == tuple(p.shape):
                state[entry] = torch.zeros_like(p, dtype=meta.properties.dtype)
            elif len(meta.size) == 0:
                state[entry] = torch.zeros((), dtype=meta.properties.dtype)
            else:
                raise CheckpointError(
                    f"{path}: optimizer state {name}.{entry} has shape {tuple(meta.size)}, the parameter {tuple(p.shape)}"
                )
        targets[name] = state
    return targets


# --- RNG states ------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """This process's torch (CPU and current CUDA device), numpy and Python RNG states, as JSON values."""
    np_state, py_state = cast(tuple[Any, ...], np.random.get_state(legacy=True)), random.getstate()
    state: dict[str, Any] = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))


def _rng_tensor(state: dict[str, Any]) -> torch.Tensor:
    # JSON bytes in a uint8 tensor: DCP stores it as data, and loading never unpickles anything.
    return torch.frombuffer(bytearray(json.dumps(state).encode()), dtype=torch.uint8)


def _rng_from_tensor(t: torch.Tensor) -> dict[str, Any]:
    return json.loads(t.numpy().tobytes().decode())


# --- geo strategy state ---------------------------------------------------------------------------
def _flatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``obj`` as JSON values, each tensor replaced by ``{"tensor": key}`` and put in ``tensors``."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj
        return {"tensor": key}
    if isinstance(obj, dict):
        return {"dict": {k: _flatten(v, tensors) for k, v in obj.items()}}
    if isinstance(obj, (list, tuple)):
        return {"list": [_flatten(v, tensors) for v in obj]}
    assert obj is None or isinstance(obj, (int, float, str, bool)), type(obj)
    return {"value": obj}


def _unflatten(node: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    if "tensor" in node:
        return tensors[node["tensor"]]
    if "dict" in node:
        return {k: _unflatten(v, tensors) for k, v in node["dict"].items()}
    if "list" in node:
        return [_unflatten(v, tensors) for v in node["list"]]
    return node["value"]


def geo_tree(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A strategy's ``state_dict()`` as DCP entries: its tensors, and its structure as JSON bytes."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _flatten(state, tensors)
    return {"structure": torch.frombuffer(bytearray(json.dumps(skeleton).encode()), dtype=torch.uint8), **tensors}


def geo_state(tree: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The inverse of `geo_tree` (nothing unpickled: the structure is JSON)."""
    skeleton = json.loads(tree["structure"].numpy().tobytes().decode())
    return _unflatten(skeleton, tree)


# --- the checkpointer the trainer drives -------------------------------------------------------------
class Checkpointer:
    """Saves every ``checkpoint.every`` steps (and at the last step), restores on ``checkpoint.resume``."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir: Path,
        model_args: ModelArgs,
        layout: dict[str, Any],
        config_toml: str,
        world: int,
    ) -> None:
        self.cfg = cfg
        self.root = Path(cfg.dir) if cfg.dir else run_dir / "checkpoints"
        self.model = dict(model_args.__dict__)
        self.layout, self.config_toml, self.world = layout, config_toml, world
        self.rank = dist.get_rank() if world > 1 else 0
        self.enabled = cfg.every > 0 or cfg.resume != "none"
        # Rank 0 alone writes and verifies manifests, so only it needs the key.
        self.key = checkpoint_key(cfg.key_file) if self.enabled and self.rank == 0 else None
        if world == 1:
            # DCP warns on every single-process save and load (also in its async thread) that it
            # assumes one process; that is the intent here.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        # A CPU group of its own: DCP's collectives may run in a background thread (async save),
        # and on CUDA the training group is NCCL, which DCP's object collectives should not use.
        self.group = dist.new_group(backend="gloo") if world > 1 and self.enabled else None
        self.folders: HostFolders | None = None
        """Set when the checkpoint folder is local to each host of a job on several hosts."""
        if self.group is not None and spans_hosts():
            folders = find_host_folders(self.root, self.rank, world, self.group)
            self.folders = folders if folders.local else None
        if self.folders is not None and self.folders.leader(self.rank):
            self.key = checkpoint_key(cfg.key_file)  # each folder's first rank verifies its own folder
        self._executor: ThreadPoolExecutor | None = None
        self._pending: tuple[int, Future[None]] | None = None
        self._abandoned = False
        self._largest_item = 0
        self.log = get_logger()

    # --- resume ---------------------------------------------------------------------------------
    def find_resume(self) -> ResumePoint | None:
        """Rank 0 verifies the checkpoint ``checkpoint.resume`` names and tells every rank; None = start fresh.

        Also deletes the ``.partial`` leftovers of saves that crashed, before any new save starts.
        """
        if not self.enabled:
            return None
        verdict: list[Any] = [None, None, None]  # path, manifest, error line
        if self.rank == 0:
            for leftover in remove_partials(self.root):
                self.log.info("checkpoint: removed %s, left by a save that did not finish", leftover)
            try:
                verdict[:2] = self._choose()
            except CheckpointError as e:
                verdict[2] = str(e)
        elif self.folders is not None and self.folders.leader(self.rank):
            remove_partials(self.root)
        if self.world > 1:
            dist.broadcast_object_list(verdict, src=0, group=self.group)
        path, manifest, error = verdict
        if error is None and path is not None and self.folders is not None:
            error = self._verify_on_hosts(Path(path))
        if error is not None:
            raise CheckpointError(error)
        return ResumePoint(Path(path), manifest) if path is not None else None

    def _verify_on_hosts(self, path: Path) -> str | None:
        """Per-host folders: each other folder's first rank verifies its own copy of the checkpoint rank 0
        chose; the first refusal, for every rank (a collective)."""
        assert self.folders is not None
        error = None
        if self.rank != 0 and self.folders.leader(self.rank):
            try:
                verify_checkpoint(path, self.model, self.key)
            except CheckpointError as e:
                error = f"{e} (on {socket.gethostname()}, whose checkpoint folder is its own)"
        errors: list[Any] = [None] * self.world
        dist.all_gather_object(errors, error, group=self.group)
        return next((e for e in errors if e is not None), None)

    def _choose(self) -> tuple[str | None, Manifest | None]:
        mode = self.cfg.resume
        if mode == "none":
            existing = committed_checkpoints(self.root)
            if existing:
                self.log.warning(
                    "checkpoint: %s already holds checkpoints up to step %d; checkpoint.resume = none starts fresh "
                    "(resume = auto would continue from them)",
                    self.root,
                    existing[0][0],
                )
            return None, None
        if mode == "auto":
            found = find_latest_good(self.root, self.model, self.key)
            if found is None:
                self.log.info("checkpoint: no good checkpoint in %s; starting fresh", self.root)
                return None, None
            path, manifest = found
        else:
            path = Path(mode)
            manifest = verify_checkpoint(path, self.model, self.key)
        # Refuse metadata that would run code here, once and before any rank reads it, so every
        # rank stops with the same line (`UnsafeCheckpoint` is never skipped like a damaged file).
        read_metadata(path, bool(manifest.hosts))
        _check_geo_layout(path, manifest.layout, self.layout)
        differ = settings_that_differ(manifest.config, self.config_toml)
        if differ and mode == "auto":
            raise CheckpointError(
                f"{path}: saved by a run with other settings ({'; '.join(differ)}); checkpoint.resume = auto continues "
                "only the same run: name the checkpoint (--checkpoint.resume PATH) to start from it anyway, "
                "or choose another train.run_dir"
            )
        if differ:
            self.log.warning("checkpoint: %s was saved with other settings: %s", path, "; ".join(differ))
        self.log.info("checkpoint: resuming from %s (step %d)", path, manifest.step)
        return str(path), manifest

    def load(self, point: ResumePoint, state: TrainState) -> int:
        """Restore ``state`` (in place) from a verified checkpoint; returns its step.

        The sampler and scheduler come from the manifest; tensors from DCP, each rank asking only
        for the names it holds, laid out as it holds them.
        """
        start = time.perf_counter()
        path, manifest = point.path, point.manifest
        with _saved_state(path / MANIFEST_FILE, "sampler"):
            state.sampler.load_state_dict(manifest.sampler)
        saved = point.saved
        same_layout = _same_layout(manifest.layout, self.layout)
        rng_key = f"rank{self.rank}" if same_layout else "rank0"
        parts = [model_state([m]) for m in state.modules]
        model = {k: v for part in parts for k, v in part.items()}
        prefix = state.replica + "." if state.replica else ""
        if prefix and not any(k.startswith(prefix + "model.") for k in saved):
            raise CheckpointError(
                f"{path}: holds no model for {state.replica} (saved under {manifest.layout.get('summary')})"
            )
        optim = _optimizer_targets(state.optimizer, state.modules, saved, path, prefix)
        rng_meta = saved.get(f"rng.{rng_key}")
        tree: StateTree = _replica_tree(state.replica, model, optim)
        if rng_meta is not None:
            tree["rng"] = {rng_key: torch.empty(tuple(rng_meta.size), dtype=torch.uint8)}
        _check_shapes(path, saved, tree)
        if point.host_local:
            self._refuse_other_hosts_pieces(point, tree)
        load_data_only(tree, path, self.group, no_dist=self.world == 1, host_local=point.host_local)

        for m, part in zip(state.modules, parts, strict=True):
            set_model_state_dict(m, {k: model[k] for k in part})
        local = _local_optimizer(state.optimizer)
        for name, p in _local_params(state.optimizer, state.modules):
            local.state[p] = optim[name]
        with _saved_state(path / MANIFEST_FILE, "scheduler"):
            state.scheduler.load_state_dict(_per_group(manifest.scheduler, len(state.optimizer.param_groups)))
            last_lr = [float(lr) for lr in state.scheduler.get_last_lr()]
        # The scheduler sets each group's lr only when it steps: put back the lr of the next step.
        for group, lr in zip(state.optimizer.param_groups, last_lr, strict=True):
            group["lr"] = lr
        if self.rank == 0 and state.geo is None and any(k.startswith("geo.") for k in saved):
            self.log.info(
                "checkpoint: saved with geo.sync = %s; this run takes datacenter 0's model and optimizer state",
                manifest.layout.get("sync"),
            )
        if "rng" in tree:
            with _saved_state(path, f"rng.{rng_key}", "is not a saved RNG state"):
                set_rng_state(_rng_from_tensor(tree["rng"][rng_key]))
        if not same_layout:
            self.log.info(
                "checkpoint: saved under layout %s, loaded under %s (resharded; every rank takes rank 0's RNG states)",
                manifest.layout.get("summary"),
                self.layout.get("summary"),
            )
        self.log.info("checkpoint: loaded step %d in %.1f s", manifest.step, time.perf_counter() - start)
        return manifest.step

    def _refuse_other_hosts_pieces(self, point: ResumePoint, tree: StateTree) -> None:
        """A checkpoint in per-host folders holds on each host only what its ranks wrote: a rank that needs
        a piece of another host's (another layout, fewer hosts) stops every rank, before any read."""
        missing = (socket.gethostname(), missing_here(tree, point.metadata))
        answers: list[Any] = [missing]
        if self.world > 1:
            answers = [None] * self.world
            dist.all_gather_object(answers, missing, group=self.group)
        rank = next((r for r, (_, names) in enumerate(answers) if names), None)
        if rank is None:
            return
        host, names = answers[rank]
        saved_on = sorted(set(point.manifest.hosts) - {host}) or ["other hosts"]
        shown = ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
        raise CheckpointError(
            f"{point.path} on {host} lacks pieces of {shown} that rank {rank} needs, saved on "
            f"{', '.join(saved_on)}: a checkpoint in per-host folders resumes only on the hosts and layout that "
            f"saved it ({point.manifest.layout.get('summary')} on {len(point.manifest.hosts)} rank(s), on "
            f"{', '.join(dict.fromkeys(point.manifest.hosts))}; this run: {self.layout.get('summary')} on "
            f"{self.world} rank(s)); resume on those hosts at that layout, or keep the checkpoints in a folder "
            "every host sees"
        )

    def load_geo(self, point: ResumePoint, geo: Any) -> None:
        """Restore the geo strategy's state after `load` (the strategy is built from the loaded model).

        A checkpoint without geo state (saved by a run without ``geo.sync``) leaves the strategy as
        built: its global snapshot is the loaded model. One saved under another layout was refused
        by `find_resume` already.
        """
        head = f"geo.rank{self.rank}."
        mine = {k[len(head) :]: v for k, v in point.saved.items() if k.startswith(head)}
        if not mine:
            self.log.info("checkpoint: %s holds no geo state; geo.sync starts from the loaded model", point.path)
            return
        tree = {k: torch.empty(tuple(meta.size), dtype=meta.properties.dtype) for k, meta in mine.items()}
        load_data_only(
            {"geo": {f"rank{self.rank}": tree}},
            point.path,
            self.group,
            no_dist=self.world == 1,
            host_local=point.host_local,
        )
        try:
            with _saved_state(point.path, f"geo.rank{self.rank}", "is not a saved geo.sync state"):
                geo.load_state_dict(geo_state(tree))
        except IsthmusError as e:
            raise CheckpointError(f"{point.path}: {e}") from None

    # --- save -----------------------------------------------------------------------------------
    def due(self, step: int, last: bool) -> bool:
        every = self.cfg.every
        return every > 0 and (step % every == 0 or last)

    def save(self, step: int, state: TrainState) -> None:
        """Save the state after ``step``; with async_save, return once the state is copied aside."""
        self.wait()  # one save in flight at a time
        partial = self.root / (step_dir_name(step) + PARTIAL_SUFFIX)
        manifest = Manifest(
            step=step,
            model=self.model,
            layout=self.layout,
            config=self.config_toml,
            sampler=state.sampler.state_dict(),
            scheduler=_json_safe(state.scheduler.state_dict()),
        )
        tree = _replica_tree(state.replica, model_state(state.modules), optimizer_state(state.optimizer, state.modules))
        tree["rng"] = {f"rank{self.rank}": _rng_tensor(rng_state())}
        if state.geo is not None:
            # A collective under streaming DiLoCo: transfers in flight are waited for and saved decoded.
            tree["geo"] = {f"rank{self.rank}": geo_tree(state.geo.state_dict())}
        options: dict[str, Any] = {"single_file_per_rank": True, "sync_files": True, "thread_count": 1}
        writer = dcp.FileSystemWriter(str(partial), **options)
        planner = None
        if self.folders is not None:
            writer = HostLocalWriter(partial, self.folders, **options)
            planner = HostLocalPlanner(self.folders)
        self._largest_item = _largest_tensor_bytes(tree)
        start = time.perf_counter()
        if not self.cfg.async_save:
            try:
                dcp.save(
                    tree, storage_writer=writer, planner=planner, process_group=self.group, no_dist=self.world == 1
                )
                self._finish(partial, manifest, start, writer)
            except (CheckpointException, OSError) as e:
                raise self._save_failed(e, step, partial) from None
            return
        # DCP copies the tensors aside before returning; training may then change them.
        # Without an async stager DCP returns a plain Future (the other type is its staging response).
        written = cast(
            Future[Any],
            dcp.async_save(
                tree, storage_writer=writer, planner=planner, process_group=self.group, no_dist=self.world == 1
            ),
        )
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="isthmus-checkpoint")
        self._pending = (step, self._executor.submit(self._finish_async, written, partial, manifest, start, writer))

    def _finish_async(self, written: Future[Any], partial: Path, manifest: Manifest, start: float, writer: Any) -> None:
        written.result()
        self._finish(partial, manifest, start, writer)

    def _finish(self, partial: Path, manifest: Manifest, start: float, writer: Any) -> None:
        """Rank 0, after every rank's files are written: manifest with checksums, rename, prune. In
        per-host folders every rank takes part, and each folder's first rank commits its own."""
        if self._abandoned:
            return
        if isinstance(writer, HostLocalWriter):
            final_here = commit_on_hosts(partial, manifest, writer, self.rank, self.group, self.key)
            if final_here is not None and self.rank != 0:
                prune(self.root, self.cfg.keep, protect=final_here)
            if self.rank != 0:
                return
            assert final_here is not None
            final = final_here
            manifest = read_manifest(final)
        elif self.rank != 0:
            return
        else:
            write_manifest(partial, manifest, key=self.key)
            final = commit(partial)
        size = sum(e["bytes"] for e in manifest.files.values())
        elapsed = time.perf_counter() - start
        self.log.info("checkpoint: saved step %d to %s (%.1f MB, %.1f s)", manifest.step, final, size / 1e6, elapsed)
        for old in prune(self.root, self.cfg.keep, protect=final):
            self.log.info("checkpoint: removed %s (checkpoint.keep = %d)", old, self.cfg.keep)

    def poll(self) -> None:
        """Surface a finished async save (its error, if it failed); never blocks."""
        if self._pending is not None and self._pending[1].done():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed."""
        if self._pending is not None:
            step, future = self._pending
            self._pending = None
            try:
                future.result()
            except (CheckpointException, OSError) as e:
                raise self._save_failed(e, step, self.root / (step_dir_name(step) + PARTIAL_SUFFIX)) from None

    def _save_failed(self, e: BaseException, step: int, partial: Path) -> BaseException:
        """A failed save as one line (DCP's CheckpointException holds each rank's error and traceback).

        Every rank is past its writes when DCP reports the failure, so rank 0 removes the files at once:
        on a full disk they are what fills it.
        """
        errors = [failure[0] for failure in e.failures.values()] if isinstance(e, CheckpointException) else [e]
        interrupt = next((err for err in errors if not isinstance(err, Exception)), None)
        if interrupt is not None:  # DCP wraps a Ctrl-C too: it stops the run, the save stays uncommitted
            return interrupt
        full = any(is_no_space(err) for err in errors) or _nearly_full(self.root, self._largest_item)
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        if full:
            return no_space(f"checkpoint of step {step}", partial, "checkpoint.dir")
        first = next((err for err in errors if isinstance(err, OSError)), errors[0])
        line = (str(first).strip().splitlines() or [""])[0]
        return RunFailed(
            f"the checkpoint of step {step} could not be written to {partial} ({type(first).__name__}: {line})"
        )

    def abandon(self) -> None:
        """After a failed step: never commit the save in flight (the next start deletes its files)."""
        self._abandoned = True
        if self._pending is not None and not self._pending[1].done():
            self.log.warning(
                "checkpoint: the save of step %d was still being written; it stays uncommitted", self._pending[0]
            )
        self._pending = None
        if self._executor is not None:
            self._executor.shutdown(wait=False)


def _largest_tensor_bytes(tree: Any) -> int:
    """Bytes of the largest tensor in a state tree (a DTensor counted whole: an upper bound)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return max((_largest_tensor_bytes(v) for v in tree.values()), default=0)
    return 0


def _nearly_full(path: Path, largest_write: int) -> bool:
    """Whether the disk holding ``path`` lacks room for one more item of the save that failed.

    DCP hands each rank's failure to rank 0 pickled, and torch's writer reports a failed write as
    "unexpected pos" without the OSError under it, so ENOSPC itself is often lost on the way; the
    free space right after the failure tells instead (a save writes one item at a time).
    """
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free < largest_write + (1 << 20)
    except OSError:
        return False


def _same_layout(saved: dict[str, Any], mine: dict[str, Any]) -> bool:
    """Whether a manifest's layout is this run's: the same fields (its ``summary`` only describes them,
    in words that may change between versions)."""
    return {k: v for k, v in saved.items() if k != "summary"} == {k: v for k, v in mine.items() if k != "summary"}


def _check_geo_layout(path: Path, saved: dict[str, Any], mine: dict[str, Any]) -> None:
    """Geo state is per rank (a datacenter's slice of DiLoCo's snapshot, a rank's residuals): a geo
    run resumes a geo checkpoint only under the layout that saved it. Runs without geo.sync load any."""
    theirs = saved.get("sync", "none")
    if mine.get("sync", "none") == "none" or theirs == "none" or _same_layout(saved, mine):
        return
    raise CheckpointError(
        f"{path}: saved with geo.sync = {theirs} under layout {saved.get('summary')} on {saved.get('world_size')} "
        f"rank(s); this run ({mine.get('summary')} on {mine.get('world_size')}) can resume it only with the same "
        "layout, or without geo.sync"
    )


@contextmanager
def _saved_state(path: Path, what: str, rule: str = "does not fit this run") -> Iterator[None]:
    """Within the block, a state the checkpoint holds that fails to read back is one line naming it.

    These states are JSON (the manifest's fields, the RNG and geo bytes), so a checkpoint written
    by another hand fails in whatever way its values lead the code to.
    """
    try:
        yield
    except IsthmusError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RuntimeError) as e:
        line = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{path}: {what} {rule} ({type(e).__name__}: {line})") from None


def _flat(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(DCP key, tensor) of every tensor in a nested state tree: dict keys joined by dots, as DCP names them."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flat(value, f"{prefix}.{key}" if prefix else key)


def _check_shapes(path: Path, saved: dict[str, Any], tree: StateTree) -> None:
    """Every tensor this rank loads is in the checkpoint with this model's shape: refused before reading."""
    for key, tensor in _flat(tree):
        meta = saved.get(key)
        if meta is None:
            raise CheckpointError(f"{path}: holds no entry {key}; saved for another model")
        if tuple(meta.size) != tuple(tensor.shape):
            raise CheckpointError(
                f"{path}: entry {key} has shape {tuple(meta.size)}; this model's is {tuple(tensor.shape)}"
            )


def _replica_tree(replica: str, model: dict[str, torch.Tensor], optim: dict[str, Any]) -> StateTree:
    """The model and optimizer entries, under ``<replica>.`` when this replica keeps its own."""
    entries: StateTree = {"model": model, "optim": optim}
    return {replica: entries} if replica else entries


def _json_safe(state: dict[str, Any]) -> dict[str, Any]:
    """A scheduler state dict as JSON values (LambdaLR keeps None for its lambdas; all else is numbers)."""
    return json.loads(json.dumps(state))


# --- reading a checkpoint without training ----------------------------------------------------------
def load_model_weights(path: Path, key: bytes | None = None) -> dict[str, torch.Tensor]:
    """The full model state dict (canonical names, whole tensors) of a checkpoint, in one process.

    Verifies the checkpoint first (its signature too, given ``key``). Reads only the model entries,
    whatever layout saved them; meant for export and inspection, not for resuming.
    """
    host_local = bool(verify_checkpoint(path, key=key).hosts)
    metadata = read_metadata(path, host_local)
    model = {
        key[len("model.") :]: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    missing = missing_here({"model": model}, metadata) if host_local else []
    if missing:
        raise CheckpointError(
            f"{path} holds this host's pieces of a checkpoint in per-host folders; it lacks pieces of {missing[0]}"
            f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}, saved on other hosts: read the model "
            "from a checkpoint in a folder every host sees"
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_data_only({"model": model}, path, host_local=host_local)
    return model
