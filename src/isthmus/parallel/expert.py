"""Expert parallelism: each rank of the ``ep`` mesh holds n_experts / ep of every MoE layer's experts.

`ExpertParallel` is torchtitan's ParallelStyle for ``GroupedExperts`` (the seam the MoE layer calls
with its token copies sorted by expert and the count per expert):

- its parameters w1, w2, w3 [n_experts, ...] become DTensors sharded by expert (``Shard(0)``) on the
  ep mesh;
- its input function sends each token copy to the rank holding its expert: first the counts per
  expert (``all_to_all_single``), from which both sides know the uneven split sizes, then the
  copies themselves (``all_to_all_single_autograd``, whose backward is the reverse all-to-all);
  what arrives is grouped by source rank, so it is regrouped by local expert;
- its output function undoes both: back to source-rank order, then the reverse all-to-all, so the
  MoE layer receives its copies' outputs in the order it sent them and weights and sums them there.

Expert parallelism folds over the data-parallel ranks (dp_shard x cp, `ParallelDims.build_mesh`):
the ep ranks hold different experts and train on different data, and the dense part of the model
is laid out exactly as without it. FSDP then shards each rank's experts over ``efsdp``, the ranks
holding the same experts, and reduces their gradients there only (`isthmus.parallel.data_parallel`).

Gradient scale. Every rank's loss is the mean over its own tokens, and data parallelism averages
gradients over the N data ranks. An expert's local gradient already sums the contributions of its
ep group's ranks (the all-to-all's backward brings them), so averaging over the N / ep ranks holding
that expert leaves it ep times too large: the experts' weight gradients are scaled by 1 / ep in
backward (`GroupedExperts.grad_scale`). FSDP2's own ``set_gradient_divide_factor`` would do it in the
reduction, but as a pre-multiplied sum, which gloo does not have.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from isthmus.models.llama import Transformer
from isthmus.models.moe import GroupedExperts, MoE


def _regroup_index(counts: Tensor) -> Tensor:
    """Row order that turns blocks [source rank][local expert] (sizes ``counts`` [ep, L]) into
    [local expert][source rank]: the order the expert loop wants, sources kept in rank order."""
    sizes = counts.flatten()
    starts = (sizes.cumsum(0) - sizes).view(counts.shape)
    seg_sizes, seg_starts = counts.t().flatten(), starts.t().flatten()
    out_starts = seg_sizes.cumsum(0) - seg_sizes
    total = int(sizes.sum())
    # Row k of segment s comes from seg_starts[s] + (k - out_starts[s]).
    offset = torch.repeat_interleave(seg_starts - out_starts, seg_sizes, output_size=total)
    return offset + torch.arange(total, device=counts.device)


class ExpertParallel(ParallelStyle):
    """Shard a ``GroupedExperts`` by expert over a 1-D mesh and route tokens to it by all-to-all.

    One instance per layer: it keeps the split sizes and the regrouping of the forward in progress
    for its output function (and a recomputed forward under activation checkpointing redoes both).
    """

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        super().__init__()
        self.ep_mesh = ep_mesh
        """The ranks tokens are exchanged with (the weights' mesh may add tensor parallelism's)."""
        self.input_splits: list[int] = []
        self.output_splits: list[int] = []
        self.regroup: Tensor | None = None

    def _partition_fn(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            placements: list[Placement] = [Shard(0)]
            full: Tensor = param
            if isinstance(param, DTensor):
                # Already split by hidden unit over tp (on meta): shard by expert over ep too, on (ep, etp).
                assert mesh.ndim == 2 and param.device.type == "meta", (mesh, param.device)
                placements.append(param.placements[0])
                full = torch.empty(param.shape, dtype=param.dtype, device="meta")
            sharded = distribute_tensor(full, mesh, placements, src_data_rank=None)
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    def _dispatch(self, module: nn.Module, inputs: tuple[Tensor, Tensor], mesh: DeviceMesh) -> tuple[Tensor, Tensor]:
        x, counts = inputs
        group = self.ep_mesh.get_group()
        ep = self.ep_mesh.size()
        with torch.no_grad():
            # received[i * L + e]: copies rank i sends to this rank's local expert e.
            received = all_to_all_single(counts, None, None, group)
            received = torch.ops._c10d_functional.wait_tensor(received)
            self.input_splits = counts.view(ep, -1).sum(dim=1).tolist()
            by_source = received.view(ep, -1)
            self.output_splits = by_source.sum(dim=1).tolist()
            self.regroup = _regroup_index(by_source)
            local_counts = by_source.sum(dim=0)
        routed = all_to_all_single_autograd(x, self.output_splits, self.input_splits, group)
        return routed[self.regroup], local_counts

    def _combine(self, module: nn.Module, out: Tensor, mesh: DeviceMesh) -> Tensor:
        assert self.regroup is not None
        # Back to [source rank][local expert] order: the inverse permutation of the regrouping.
        by_source = out[torch.argsort(self.regroup)]
        return all_to_all_single_autograd(by_source, self.input_splits, self.output_splits, self.ep_mesh.get_group())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partition_fn=self._partition_fn,
            input_fn=self._dispatch,  # type: ignore[arg-type]
            output_fn=self._combine,  # type: ignore[arg-type]
        )


def apply_ep(model: Transformer, experts_mesh: DeviceMesh) -> None:
    """Expert-parallelise every MoE layer of ``model`` (on the meta device, after tensor parallelism,
    before FSDP). ``experts_mesh``: the ``ep`` mesh, or (ep, etp) when tensor parallelism already
    split the experts by hidden unit (`isthmus.parallel.tp.shard_moe_locally`)."""
    ep_mesh = experts_mesh["ep"] if experts_mesh.ndim == 2 else experts_mesh
    for block in model.layers.values():
        ffn: Any = block.get_submodule("feed_forward")
        if isinstance(ffn, MoE):
            assert isinstance(ffn.experts, GroupedExperts)
            assert ffn.n_experts % ep_mesh.size() == 0, (ffn.n_experts, ep_mesh.size())
            ExpertParallel(ep_mesh)._apply(ffn.experts, experts_mesh)
            ffn.experts.grad_scale = 1.0 / ep_mesh.size()
