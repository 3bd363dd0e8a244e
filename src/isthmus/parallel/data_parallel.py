"""Data parallelism: DDP over replicas, ZeRO-1 via a sharded optimizer, ZeRO-2/3 and HSDP via FSDP2.

| layout                               | wrapper                                            |
|--------------------------------------|----------------------------------------------------|
| dp_replicate and/or cp, no tp/shard  | DDP (all-reduce of gradients)                      |
| dp_shard, zero_stage 1               | DDP + ZeroRedundancyOptimizer (optimizer state 1/N)|
| dp_shard, zero_stage 2               | FSDP2, parameters kept gathered from forward to backward |
| dp_shard, zero_stage 3               | FSDP2, parameters re-sharded after forward          |
| dp_replicate x dp_shard (HSDP)       | FSDP2 on the 2-D (replicate, shard) mesh            |
| any dp/cp with tp or pp              | FSDP2 (DDP holds neither DTensors nor pipeline stages) |
"""

from __future__ import annotations

from typing import Literal

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from isthmus.models.llama import Transformer
from isthmus.parallel.dims import Meshes, ParallelDims

DataParallelKind = Literal["none", "ddp", "zero1", "fsdp"]


def data_parallel_kind(dims: ParallelDims, zero_stage: int, geo_sync: bool = False) -> DataParallelKind:
    if geo_sync:
        # The geo strategy averages over replicas itself (isthmus.geo); FSDP2 still shards inside
        # each datacenter, over dp_shard x cp only (`fsdp_mesh`), and the strategy then works on
        # the shards.
        return "fsdp" if dims.dp_shard_enabled else "none"
    if dims.dp_shard_enabled and zero_stage == 1:
        return "zero1"
    # DDP holds neither DTensor parameters (tp) nor pipeline stages run micro-batch by micro-batch
    # (pp): FSDP2 with a shard size of 1 is pure replication and composes with both.
    if dims.dp_shard_enabled or ((dims.tp_enabled or dims.pp_enabled) and dims.grad_sync_degree > 1):
        return "fsdp"
    if dims.grad_sync_degree > 1:
        return "ddp"
    return "none"


def fsdp_mesh(mesh: "Meshes", dims: ParallelDims, geo_sync: bool = False) -> DeviceMesh:
    """HSDP when replicas exist (replicate over dp_replicate, shard over dp_shard x cp), else 1-D.
    Under a geo strategy always 1-D: the strategy reduces over the replicas."""
    if dims.dp_replicate_enabled and not geo_sync:
        return mesh["replicate", "dp_shard_cp"]
    return mesh["dp_shard_cp"]


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, zero_stage: int, reshard_root: bool = True) -> nn.Module:
    """Shard each transformer block, then the root (embedding, final norm, head) as one group.

    Per-block groups let FSDP2 gather one block's parameters while the previous block computes.
    """

    reshard = zero_stage == 3
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard and reshard_root)
    return model


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:

    # Each rank's loss is the mean over its own tokens; DDP averages gradients over the group,
    # which makes the gradient of the mean loss over the whole batch.
    # gradient_as_bucket_view: gradients live in DDP's buckets instead of a second full copy.
    return DistributedDataParallel(model, process_group=dp_mesh.get_group(), gradient_as_bucket_view=True)
