"""Gradient-norm clipping that sees the whole model, however it is split."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from isthmus.train.hooks import Wait, wait_for


def clip_grad_norm(
    params: list[nn.Parameter],
    max_norm: float,
    pp_group: dist.ProcessGroup | None = None,
    wait: Wait = wait_for,
) -> float:
    """Clip to ``max_norm`` by the global gradient norm; returns that norm.

    ``wait(work, name)`` waits for the all-reduce over ``pp_group`` (the trainer's step hooks fill
    it with prefill: a stage that finished its backward waits here for the others).

    DTensor gradients (FSDP, TP) give a DTensor norm whose ``full_tensor`` reduces over their mesh;
    pipeline stages hold disjoint parameters, so their squared norms are summed over ``pp_group``
    (torch's ``clip_grad_norm_`` knows nothing of stages, hence this wrapper).
    """

    # Gradients may live on different meshes (with FSDP + TP, norm weights that TP leaves alone are
    # on the data-parallel mesh only), and DTensor ops refuse to mix meshes: one norm per mesh.
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    sq = torch.zeros((), dtype=torch.float64)
    for grads in by_mesh.values():
        part = torch.nn.utils.get_total_norm(grads, 2.0, foreach=False)
        part = part.full_tensor() if isinstance(part, DTensor) else part
        sq = sq + part.detach().double().cpu() ** 2
    total = sq.sqrt().float()
    if pp_group is not None:
        work = dist.all_reduce(sq, group=pp_group, async_op=True)
        assert work is not None
        wait(work, "all-reduce grad norm")
        total = sq.sqrt().float()
    norm = total.item()
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:  # a Python float scales DTensor and plain gradients alike
        for grads in by_mesh.values():
            for g in grads:
                g.mul_(coef)
    return norm
