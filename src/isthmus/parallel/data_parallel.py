"""Data parallelism: DDP over replicas, ZeRO-1 via a sharded optimizer, ZeRO-2/3 and HSDP via FSDP2.

| layout                               | wrapper                                            |
|--------------------------------------|----------------------------------------------------|
| dp_replicate and/or cp, no tp/shard  | DDP (all-reduce of gradients)                      |
| dp_shard alone, zero_stage 1         | DDP + ZeroRedundancyOptimizer (optimizer state 1/N)|
| dp_shard and/or cp, zero_stage 1, with tp, pp, cp or dp_replicate | FSDP2 replicating (shard size 1) + `ShardedOptimizer` (optimizer state 1/N) |
| dp_shard, zero_stage 2               | FSDP2, parameters kept gathered from forward to backward |
| dp_shard, zero_stage 3               | FSDP2, parameters re-sharded after forward          |
| dp_replicate x dp_shard (HSDP)       | FSDP2 on the 2-D (replicate, shard) mesh            |
| any dp/cp with tp or pp              | FSDP2 (DDP holds neither DTensors nor pipeline stages) |

ZeRO-1's N is dp_shard x cp (replicas keep their own copy of the optimizer state, as HSDP's do);
`isthmus.train.zero1.ShardedOptimizer` says why it is not torch's ZeroRedundancyOptimizer there.

Under bf16 (``train.dtype``) FSDP2's own mixed precision computes: the sharded fp32 parameters stay
the optimizer's master copy, each block is gathered in bf16 and its gradients reduced in fp32
(``MixedPrecisionPolicy``, torchtitan's way). DDP and single-process layouts compute under
``torch.autocast`` instead, which needs no wrapper. Why not autocast everywhere: its cast cache keeps
a bf16 copy of every gathered weight until the autocast region ends (a microbatch's forward and
backward), which undoes ZeRO-3's sharding, and FSDP would gather fp32 weights, twice the bytes.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.nn.parallel import DistributedDataParallel

from isthmus.layout import rules
from isthmus.layout.dims import Meshes, ParallelDims
from isthmus.layout.rules import DataParallelKind
from isthmus.models.llama import Transformer


def data_parallel_kind(dims: ParallelDims, zero_stage: int, geo_sync: bool = False) -> DataParallelKind:
    """The rule :func:`isthmus.layout.rules.data_parallel_kind` (the planner's ``shard_degree`` too) for ``dims``."""
    return rules.data_parallel_kind(
        dims.dp_shard, dims.cp, dims.tp, dims.pp, dims.replicate, zero_stage, geo_sync, dims.ep
    )


def sharded_optimizer(dims: ParallelDims, zero_stage: int, geo_sync: bool = False) -> bool:
    """The rule :func:`isthmus.layout.rules.sharded_optimizer` for ``dims``: ZeRO-1 over FSDP2 replication."""
    kind = data_parallel_kind(dims, zero_stage, geo_sync)
    return rules.sharded_optimizer(kind, zero_stage, dims.dp_shard, dims.cp)


def zero1_mesh(mesh: Meshes) -> DeviceMesh:
    """What FSDP2 runs on under ZeRO-1 next to tp/pp/cp/replicas: HSDP whose shard groups are one
    rank each, over every data-parallel and context-parallel rank. It replicates the weights and
    all-reduces the gradients, composing with DTensor (tp) parameters and pipeline stages as the
    other FSDP2 layouts do, while the optimizer state is sharded by `ShardedOptimizer` instead.
    Unflattened from the root mesh (FSDP accepts tp's DTensors on it); every rank calls it once."""
    dp_cp = mesh["dp_cp"]
    return dp_cp._unflatten(0, (dp_cp.size(), 1), ("zero1_replicate", "zero1_shard"))


def fsdp_mesh(mesh: Meshes, dims: ParallelDims, geo_sync: bool = False) -> DeviceMesh:
    """HSDP when replicas exist (replicate over dp_replicate, shard over dp_shard x cp), else 1-D.
    Under a geo strategy always 1-D: the strategy reduces over the replicas."""
    if dims.dp_replicate_enabled and not geo_sync:
        return mesh["replicate", "dp_shard_cp"]
    return mesh["dp_shard_cp"]


def mixed_precision(dtype: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``train.dtype``: bf16 compute weights over fp32 masters, fp32 reductions
    (a bf16 reduce-scatter would round every rank's gradient before the sum); fp32 casts nothing."""
    if dtype == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def expert_fsdp_mesh(mesh: Meshes, dims: ParallelDims, geo_sync: bool = False) -> DeviceMesh | None:
    """Under expert parallelism, what FSDP shards and reduces the experts over: the ranks holding the
    same experts (efsdp, with e_replicate as HSDP's replicas where the dense part has them); None without."""
    if mesh.experts is None:
        return None
    if dims.dp_replicate_enabled and not geo_sync:
        return mesh.experts["e_replicate", "efsdp"]
    return mesh.experts["efsdp"]


def apply_fsdp(
    model: Transformer,
    dp_mesh: DeviceMesh,
    zero_stage: int,
    reshard_root: bool = True,
    dtype: str = "fp32",
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shard each transformer block, then the root (embedding, final norm, head) as one group.

    Per-block groups let FSDP2 gather one block's parameters while the previous block computes.
    With ``expert_mesh`` (expert parallelism) a MoE block's routed experts are a group of their own
    on that mesh, as torchtitan does; the router and shared experts stay with the block.
    """

    reshard = zero_stage == 3
    policy = mixed_precision(dtype)
    for block in model.layers.values():
        experts = getattr(block.get_submodule("feed_forward"), "experts", None)
        if expert_mesh is not None and experts is not None:
            local = experts.w1.to_local().shape[0]
            # Fewer local experts than shards: shard the experts' hidden dimension rather than pad.
            placement = (lambda _: Shard(1)) if local < expert_mesh.size(-1) else None
            fully_shard(
                experts, mesh=expert_mesh, reshard_after_forward=reshard, mp_policy=policy, shard_placement_fn=placement
            )
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard and reshard_root, mp_policy=policy)
    return model


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:

    # Each rank's loss is the mean over its own tokens; DDP averages gradients over the group,
    # which makes the gradient of the mean loss over the whole batch.
    # gradient_as_bucket_view: gradients live in DDP's buckets instead of a second full copy.
    return DistributedDataParallel(model, process_group=dp_mesh.get_group(), gradient_as_bucket_view=True)
