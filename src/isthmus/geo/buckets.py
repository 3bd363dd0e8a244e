"""Flat fp32 buffers over a list of parameters: one collective per bucket instead of one per tensor."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (tensor parallelism), else ``t``.

    Datacenters hold the same parts in the same places, so a strategy reduces each rank's local
    shard with its counterparts; under no_grad the shard aliases the DTensor's storage.
    """
    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


@dataclass
class Bucket:
    """Consecutive parameters packed end to end, zero-padded to a multiple the collective needs."""

    index: list[int]
    """Positions of the bucket's parameters in the strategy's parameter list."""
    offsets: list[int]
    """Start of each parameter in the flat buffer."""
    numel: int
    """Elements of real data."""
    padded: int
    """Buffer length: numel rounded up to the padding multiple."""

    def shard(self, rank: int, size: int) -> slice:
        """The ``rank``-th of ``size`` equal slices of the padded buffer (as reduce-scatter cuts it)."""
        n = self.padded // size
        return slice(rank * n, (rank + 1) * n)


def build_buckets(
    params: list[nn.Parameter], max_numel: int, multiple: int, index: list[int] | None = None
) -> list[Bucket]:
    """Group ``params`` (in order) into buckets of at most ``max_numel`` elements, padded to ``multiple``.

    ``index`` gives each parameter's position in the full list when ``params`` is a sub-list.
    """
    index = list(range(len(params))) if index is None else index
    buckets: list[Bucket] = []
    cur: list[int] = []
    offsets: list[int] = []
    numel = 0

    def close() -> None:
        padded = -(-numel // multiple) * multiple
        buckets.append(Bucket(list(cur), list(offsets), numel, padded))

    for i, p in zip(index, params):
        if cur and numel + local(p).numel() > max_numel:
            close()
            cur, offsets, numel = [], [], 0
        cur.append(i)
        offsets.append(numel)
        numel += local(p).numel()
    if cur:
        close()
    return buckets


def split_fragments(params: list[nn.Parameter], n: int) -> list[list[int]]:
    """Cut the parameter list into ``n`` contiguous, non-empty runs of about equal element counts.

    Contiguous runs of a transformer's parameters are runs of layers (Streaming DiLoCo's "sequential"
    pattern). Cut ``j`` falls at the first parameter boundary where the running count reaches
    ``j * total / n``, moved just enough to leave every fragment at least one parameter.
    """
    assert 1 <= n <= len(params), f"{n} fragments need at least {n} parameters, have {len(params)}"
    prefix = [0]
    for p in params:
        prefix.append(prefix[-1] + local(p).numel())
    total = prefix[-1]
    cuts = [0]
    for j in range(1, n):
        c = next(i for i, s in enumerate(prefix) if s * n >= j * total)
        cuts.append(min(max(c, cuts[-1] + 1), len(params) - (n - j)))
    cuts.append(len(params))
    return [list(range(a, b)) for a, b in zip(cuts, cuts[1:])]


def pack_grads(params: list[nn.Parameter], bucket: Bucket, out: torch.Tensor) -> torch.Tensor:
    """Pack the gradients of the bucket's parameters; a missing gradient packs as zeros."""
    for i, off in zip(bucket.index, bucket.offsets):
        param = params[i]
        p = local(param)
        dst = out[off : off + p.numel()]
        if isinstance(param, DTensor) and isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
            # Autograd may leave a tp gradient partial or replicated (vocab-parallel embedding, the
            # loss-parallel head): lay it out like its parameter, as FSDP would before reducing.
            param.grad = param.grad.redistribute(param.device_mesh, param.placements)
        grad = param.grad
        if grad is None:
            dst.zero_()
        else:
            dst.copy_(local(grad).detach().reshape(-1))
    out[bucket.numel :].zero_()
    return out


def unpack_grads(buf: torch.Tensor, params: list[nn.Parameter], bucket: Bucket) -> None:
    """Write ``buf`` back as the bucket's gradients (creating those that were missing)."""
    for i, off in zip(bucket.index, bucket.offsets):
        param = params[i]
        p = local(param)
        src = buf[off : off + p.numel()].view_as(p)
        if param.grad is None:
            grad = src.to(p.dtype).clone()
            if isinstance(param, DTensor):
                grad = DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False)
            param.grad = grad
        else:
            local(param.grad).copy_(src)


def pack_params(params: list[nn.Parameter], bucket: Bucket, out: torch.Tensor) -> torch.Tensor:
    """Pack the bucket's parameter values."""
    for i, off in zip(bucket.index, bucket.offsets):
        p = local(params[i])
        out[off : off + p.numel()].copy_(p.detach().reshape(-1))
    out[bucket.numel :].zero_()
    return out


def unpack_params(buf: torch.Tensor, params: list[nn.Parameter], bucket: Bucket) -> None:
    """Write ``buf`` back as the bucket's parameter values."""
    with torch.no_grad():
        for i, off in zip(bucket.index, bucket.offsets):
            p = local(params[i])
            p.copy_(buf[off : off + p.numel()].view_as(p))
