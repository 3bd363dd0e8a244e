"""Gradient-norm clipping that sees the whole model, however it is split."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None = None) -> float:
    """Clip to ``max_norm`` by the global gradient norm; returns that norm.

    DTensor gradients (FSDP, TP) give a DTensor norm whose ``full_tensor`` reduces over their mesh;
    pipeline stages hold disjoint parameters, so their squared norms are summed over ``pp_group``
    (torch's ``clip_grad_norm_`` knows nothing of stages, hence this wrapper).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        total = torch.nn.utils.get_total_norm(grads, 2.0, foreach=False)
    else:  # a pipeline stage can, in principle, own no trainable parameter
        total = torch.zeros(())
    from torch.distributed.tensor import DTensor

    if isinstance(total, DTensor):
        total = total.full_tensor()
    if pp_group is not None:
        sq = total.detach().double() ** 2
        dist.all_reduce(sq, group=pp_group)
        total = sq.sqrt().to(total.dtype)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=False)
    return float(total)
