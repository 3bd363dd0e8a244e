"""Checkpoints in per-host folders: a job on several hosts whose checkpoint folder is local to each host.

Every rank writes its own DCP file (``__<rank>_0.distcp``) into its host's ``step-N.partial``, as
with one shared folder. What differs:

- **Replicated entries once per host, not once per job.** DCP writes an entry that several ranks
  hold (a DDP parameter, AdamW's step count) once, by one rank of the whole job; `HostLocalPlanner`
  picks one rank on each host instead, so that a restart at the same layout finds every entry its
  ranks need on their own host. Sharded entries (FSDP, tensor parallelism) are written by their
  owners alone, as always.
- **Each host's own ``.metadata``.** DCP's metadata maps every saved piece to the file that holds
  it; DCP writes it once, on the coordinator (rank 0). `HostLocalWriter` keeps the same table of
  entries for every host and, for each, the storages of that host's files only; rank 0 writes its
  host's, and each other host's first rank writes its own (`commit_on_hosts`), with that host's
  manifest (signed by rank 0, listing that host's files), then commits the folder there.

DCP itself has no notion of hosts (its planner dedups over the world, its writer writes one
metadata file on the coordinator): these two subclasses add it. A restart reads each host's own
metadata (every rank reads ``.metadata`` itself in ``dcp.load``); a piece it would need from another
host (another layout, fewer hosts) is refused before any read (`missing_here`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import io
import os
import pickle
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from isthmus.checkpoint.manifest import (
    DCP_METADATA_FILE,
    MANIFEST_FILE,
    Manifest,
    commit,
    file_digest,
    manifest_text,
    write_file_synced,
)

PROBE_FILE = ".hosts"
"""Written by rank 0 in the checkpoint folder with a fresh token: a host that reads it back shares the folder."""


@dataclass(frozen=True)
class HostFolders:
    """Which ranks share a checkpoint folder: group 0 is rank 0's folder, every other group one host's own."""

    hosts: list[str]
    """The host of each rank."""
    group: list[int]
    """The folder group of each rank."""

    @property
    def local(self) -> bool:
        """Whether some rank does not see rank 0's folder."""
        return any(self.group)

    def ranks(self, group: int) -> list[int]:
        return [r for r, g in enumerate(self.group) if g == group]

    def leader(self, rank: int) -> bool:
        """Whether ``rank`` is the first rank of its folder group (it writes that folder's metadata)."""
        return self.ranks(self.group[rank])[0] == rank


def spans_hosts() -> bool:
    """Whether this process is a rank of a launch (torchrun) whose ranks run on more than one host (as
    `isthmus.launch.environ.spans_hosts`, which this package may not import)."""
    try:
        return "RANK" in os.environ and int(os.environ["WORLD_SIZE"]) > int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return False


def find_host_folders(root: Path, rank: int, world: int, group: Any) -> HostFolders:
    """Which ranks see rank 0's checkpoint folder ``root`` (a collective over ``group``): rank 0 leaves a
    token there, every rank looks for it. Ranks that do not see it keep a folder per host."""
    token = [uuid.uuid4().hex if rank == 0 else None]
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        (root / PROBE_FILE).write_text(str(token[0]))
    dist.broadcast_object_list(token, src=0, group=group)
    try:
        sees = (root / PROBE_FILE).read_text() == token[0]
    except OSError:
        sees = False
    answers: list[Any] = [None] * world
    dist.all_gather_object(answers, (socket.gethostname(), sees), group=group)
    own_hosts = sorted({host for host, seen in answers if not seen})
    groups = [0 if seen else 1 + own_hosts.index(host) for host, seen in answers]
    return HostFolders([host for host, _ in answers], groups)


class HostLocalPlanner(DefaultSavePlanner):
    """DCP's save planner, with replicated entries written once on each folder group (see the module doc).

    The metadata it returns is DCP's own (each piece once); the plans say who writes what."""

    def __init__(self, folders: HostFolders) -> None:
        super().__init__()
        self.folders = folders

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        _, metadata = super()._create_global_plan(all_plans)  # DCP's dedup over the world, for the metadata
        plans = list(all_plans)
        for group in sorted(set(self.folders.group)):
            ranks = self.folders.ranks(group)
            for rank, plan in zip(ranks, dedup_save_plans([all_plans[r] for r in ranks]), strict=True):
                plans[rank] = plan
        return plans, metadata


class HostLocalWriter(FileSystemWriter):
    """DCP's file-system writer; on the coordinator, one ``.metadata`` per folder group: its own
    group's written as DCP writes it, the others' kept in `others` for their first ranks to write."""

    def __init__(self, path: Path, folders: HostFolders, **kwargs: Any) -> None:
        super().__init__(str(path), **kwargs)
        self.folders = folders
        self.others: dict[int, bytes] = {}

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        for group in sorted(set(self.folders.group) - {0}):
            theirs = copy.copy(metadata)
            theirs.storage_data = {wr.index: wr.storage_data for r in self.folders.ranks(group) for wr in results[r]}
            theirs.storage_meta = self.storage_meta()
            buffer = io.BytesIO()
            pickle.dump(theirs, buffer)
            self.others[group] = buffer.getvalue()
        super().finish(metadata, [results[r] for r in self.folders.ranks(0)])


def missing_here(tree: dict[str, Any], metadata: Metadata) -> list[str]:
    """The entries of ``tree`` (a rank's load targets) with a piece this host's metadata has no storage for."""
    planner = DefaultLoadPlanner()
    planner.set_up_planner(copy.copy(tree), metadata, is_coordinator=False)
    plan = planner.create_local_plan()
    return sorted({item.storage_index.fqn for item in plan.items if item.storage_index not in metadata.storage_data})


def commit_on_hosts(
    partial: Path, manifest: Manifest, writer: HostLocalWriter, rank: int, group: Any, key: bytes | None
) -> Path | None:
    """Every rank, after DCP's save returned: rank 0 gathers each rank's file size and sha256 and makes
    each folder group's manifest (signed with ``key``); each group's first rank writes its metadata and
    manifest and commits its folder. Returns the committed folder on those ranks, None on the others."""
    folders = writer.folders
    own = partial / f"__{rank}_0.distcp"  # FileSystemWriter's name with single_file_per_rank
    mine = {}
    if own.is_file():
        size, sha = file_digest(own)
        mine[own.name] = {"bytes": size, "sha256": sha}
    found: list[Any] = [None] * len(folders.group)
    dist.all_gather_object(found, mine, group=group)
    packets: list[Any] = [None]
    if rank == 0:
        packets[0] = {}
        for g in sorted(set(folders.group)):
            data = (partial / DCP_METADATA_FILE).read_bytes() if g == 0 else writer.others[g]
            files = {name: entry for r in folders.ranks(g) for name, entry in found[r].items()}
            files[DCP_METADATA_FILE] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            ours = dataclasses.replace(manifest, files=dict(sorted(files.items())), hosts=folders.hosts)
            packets[0][g] = (None if g == 0 else data, manifest_text(ours, key))
    dist.broadcast_object_list(packets, src=0, group=group)
    final = None
    if folders.leader(rank):
        data, text = packets[0][folders.group[rank]]
        if data is not None:
            write_file_synced(partial / DCP_METADATA_FILE, data)
        write_file_synced(partial / MANIFEST_FILE, text.encode())
        final = commit(partial)
    dist.barrier(group=group)
    return final
