"""`ExpertBalance`: a MoE run's expert loads in the metrics, and the bias method's update.

A step hook (`isthmus.train.hooks.StepHooks`). After each optimizer step it takes what every MoE
layer of this rank counted in the step's forwards (`isthmus.models.moe.MoE.take_load`) and sums it
over the whole job in one small all-reduce, so every rank holds every layer's load over the whole
global batch. With ``load_balance = "bias"`` each rank then moves its layers' ``expert_bias`` by
``bias_update_rate * sign(mean load - load_e)``: computed from the same sums everywhere, so every
replica of a layer (data parallel, ZeRO shards, pipeline and tensor-parallel peers) applies the same
update and the replicas stay identical without a broadcast (arXiv 2408.15664).

Summed over the whole job rather than the data-parallel group: pipeline stages hold different
layers, and one all-reduce over everyone gives rank 0, which logs, every layer. Ranks that saw the
same tokens (tensor-parallel peers) count them more than once; each layer's row carries how many
ranks added to it, and the sum is scaled back to the data-parallel ranks' count.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from isthmus.models.args import ModelArgs
from isthmus.models.moe import MoE


class ExpertBalance:
    """Expert-load metrics and the bias update of a MoE run's layers on this rank."""

    def __init__(self, layers: list[MoE], args: ModelArgs, data_ranks: int, world: int, device: torch.device) -> None:
        """``data_ranks``: the ranks that see different tokens (dp x cp); ``world``: every rank; ``device``:
        where the all-reduce's buffer lives (nccl reduces only CUDA tensors)."""
        self.layers = layers
        self.device = device
        self.args = args
        self.data_ranks = data_ranks
        self.world = world
        self._metrics: dict[str, Any] = {}

    def begin_step(self, step: int) -> None:
        pass

    def span(self, what: str) -> nullcontext[None]:
        return nullcontext()

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        pass

    def wait(self, work: Any, name: str, inner: Any) -> None:
        inner(work, name)

    def after_optimizer_step(self, step: int, params: list[nn.Parameter]) -> None:
        totals = self.summed_loads()
        if self.args.load_balance == "bias" and self.args.bias_update_rate > 0:
            self.update_biases(totals[:, : self.args.n_experts])
        self._metrics = self.load_metrics(totals)

    def end_step(self, step: int) -> dict[str, Any]:
        return self._metrics

    def finish(self, params: list[nn.Parameter]) -> None:
        pass

    def summed_loads(self) -> torch.Tensor:
        """[MoE layers, n_experts + 3]: per layer, the token copies each expert got over the global batch,
        then the copies dropped, the aux losses' sum and the forwards that made it (all data ranks)."""
        n_experts = self.args.n_experts
        rows = torch.zeros(self.args.n_moe_layers, n_experts + 4, dtype=torch.float64)
        for layer in self.layers:
            load = layer.take_load()
            if load is None:
                continue
            row = rows[layer.layer_id - self.args.n_dense_layers]
            row[:n_experts] = load.tokens.double().cpu()
            row[n_experts] = float(load.dropped)
            row[n_experts + 1] = float(load.aux_loss_sum)
            row[n_experts + 2] = load.forwards
            row[n_experts + 3] = 1.0  # this rank added to the row
        if self.world > 1:
            rows = rows.to(self.device)
            dist.all_reduce(rows)  # gloo and nccl both sum float64
            rows = rows.cpu()
        holders = rows[:, -1:].clamp(min=1.0)
        return rows[:, :-1] * (self.data_ranks / holders)

    @torch.no_grad()
    def update_biases(self, tokens: torch.Tensor) -> None:
        """bias_e += rate * sign(mean load - load_e) on every layer this rank holds."""
        rate = self.args.bias_update_rate
        for layer in self.layers:
            load = tokens[layer.layer_id - self.args.n_dense_layers]
            delta = (rate * torch.sign(load.mean() - load)).float()
            add_to_parameter(layer.router.expert_bias, delta)

    def load_metrics(self, totals: torch.Tensor) -> dict[str, Any]:
        """``expert_load``: per MoE layer, each expert's share of the token copies; ``expert_load_min``
        / ``_max``: the least and most loaded expert over the layers, as a multiple of an even share;
        ``moe_aux_loss`` (mean over layers and micro-batches) and ``tokens_dropped`` (share of copies)
        when they apply."""
        n_experts = self.args.n_experts
        tokens = totals[:, :n_experts]
        copies = tokens.sum(dim=1, keepdim=True).clamp(min=1.0)
        share = tokens / copies
        out: dict[str, Any] = {
            "expert_load": [[round(float(v), 4) for v in row] for row in share],
            "expert_load_min": float(share.min()) * n_experts,
            "expert_load_max": float(share.max()) * n_experts,
        }
        if self.args.load_balance == "aux_loss":
            forwards = totals[:, n_experts + 2].clamp(min=1.0)
            out["moe_aux_loss"] = float((totals[:, n_experts + 1] / forwards).mean())
        if self.args.capacity_factor > 0:
            out["tokens_dropped"] = float(totals[:, n_experts].sum() / copies.sum())
        return out


def add_to_parameter(p: nn.Parameter, delta: torch.Tensor) -> None:
    """Add a full-size ``delta`` to ``p``, or to this rank's shard of it when ``p`` is a DTensor (FSDP,
    expert parallelism): each rank slices the same delta, no communication."""
    if isinstance(p, DTensor):
        shard = distribute_tensor(delta.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
        p.to_local().add_(shard.to_local())
    else:
        p.add_(delta.to(p.device))
