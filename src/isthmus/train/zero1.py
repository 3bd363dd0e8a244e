"""ZeRO-1 over local tensors: the optimizer state of each parameter lives on one rank of a group.

Megatron's distributed optimizer, as ``parallel.zero_stage 1`` runs it next to tensor, pipeline or
context parallelism or replicas: FSDP2 replicates the weights and all-reduces the gradients
(`isthmus.parallel.data_parallel.zero1_mesh`), so every rank of the group holds the whole reduced
gradient; each parameter's optimizer state is kept by one owner rank, which steps that parameter
and broadcasts it to the others. The step runs in two phases: every rank updates the parameters it
owns, then a broadcast of each parameter from its owner brings the others'.

Why not torch's ZeroRedundancyOptimizer (which the dp_shard-alone layout uses over DDP): it keeps
plain tensors only, bucketing parameters by ``.data``, while here the parameters are DTensors
(FSDP2's, and tensor parallelism's shards). This optimizer steps the DTensors themselves and
communicates their local tensors: a tensor-parallel shard is broadcast among the ranks holding the
same shard, never gathered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``p``: a DTensor's local shard, a plain tensor itself."""
    return p.to_local() if isinstance(p, DTensor) else p.data


def partition(sizes: list[int], ranks: int) -> list[int]:
    """The owner rank of each of ``sizes`` (elements per parameter), balanced by size: largest first,
    each to the rank holding the fewest elements so far (ZeroRedundancyOptimizer's greedy rule)."""
    load = [0] * ranks
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = min(range(ranks), key=lambda r: load[r])
        owner[i] = r
        load[r] += sizes[i]
    return owner


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` over the parameters this rank of ``group`` owns, the rest updated by
    broadcast from their owners.

    ``param_groups`` hold every parameter (the LR scheduler sets them, ``zero_grad`` clears them);
    ``optim`` is the local optimizer, with one group per group here (possibly empty), its state only
    for the owned parameters: what a checkpoint saves and loads by parameter name.
    """

    def __init__(
        self, groups: Iterable[dict[str, Any]], group: dist.ProcessGroup, optimizer_class: type, **defaults: Any
    ) -> None:
        super().__init__(list(groups), defaults)
        self.group = group
        self.rank, size = dist.get_rank(group), dist.get_world_size(group)
        params = [p for g in self.param_groups for p in g["params"]]
        owners = partition([local_tensor(p).numel() for p in params], size)
        self.owner = {id(p): r for p, r in zip(params, owners, strict=True)}
        self.owned_by: list[list[nn.Parameter]] = [[p for p, r in zip(params, owners) if r == k] for k in range(size)]
        local = [{**g, "params": [p for p in g["params"] if self.owner[id(p)] == self.rank]} for g in self.param_groups]
        self.optim: torch.optim.Optimizer = optimizer_class(local, **defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        assert closure is None, "ShardedOptimizer takes no closure"
        for mine, outer in zip(self.optim.param_groups, self.param_groups, strict=True):
            mine.update({k: v for k, v in outer.items() if k != "params"})  # the scheduler's lr
        self.optim.step()
        self._broadcast()
        return None

    def _broadcast(self) -> None:
        """Every owner's updated parameters to the other ranks, in place: one broadcast per local
        tensor, all in flight at once. In place rather than through a flat buffer per owner, which
        would hold a second copy of every weight during the step."""
        pending = []
        for r, params in enumerate(self.owned_by):
            src = dist.get_global_rank(self.group, r)
            for p in params:
                t = local_tensor(p)
                assert t.is_contiguous(), "a broadcast fills a contiguous tensor in place"
                pending.append(dist.broadcast(t, src=src, group=self.group, async_op=True))
        for work in pending:
            work.wait()
