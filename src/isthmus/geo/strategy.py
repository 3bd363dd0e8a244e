"""`GeoSync`: what every cross-datacenter strategy offers the trainer, and its counted collectives.

The trainer calls, per optimizer step (through `isthmus.geo.run.GeoRun`, which owns the strategy)::

    loss.backward()
    sync.reduce_gradients(params)          # average gradients as the strategy says
    clip, optimizer.step(), zero_grad
    sync.after_optimizer_step(step, params)  # step = 0-based index of the step just taken

and ``sync.finish(params)`` once after the last step. Every collective goes through
``_all_reduce`` / ``_reduce_scatter`` / ``_all_gather`` here, which add this rank's share to
``bytes_sent`` by link tier (see :mod:`isthmus.geo.accounting` for how it is counted).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from isthmus.config import GeoConfig
from isthmus.errors import IsthmusError
from isthmus.geo import accounting
from isthmus.geo.accounting import Scope
from isthmus.geo.groups import GeoGroups
from isthmus.parallel.striped import StripedWork, striped_all_gather, striped_all_reduce


def copy_state(name: str, mine: list[Tensor], saved: list[Tensor]) -> None:
    """Copy saved tensors into this strategy's, refusing a checkpoint of another layout."""
    if len(mine) != len(saved) or any(a.shape != b.shape for a, b in zip(mine, saved)):
        raise IsthmusError(
            f"geo checkpoint {name} has shapes {[tuple(b.shape) for b in saved]}, this run needs "
            f"{[tuple(a.shape) for a in mine]} (same model, datacenters, ranks and geo settings?)"
        )
    for a, b in zip(mine, saved):
        a.copy_(b)


class Work(Protocol):
    def wait(self) -> Any: ...


class _Done:
    """The handle of a collective that needed no communication (a group of one rank)."""

    def wait(self) -> bool:
        return True


class GeoSync:
    """Base strategy: counted collectives over the geo groups, and the trainer-facing hooks."""

    kind = "none"

    def __init__(self, groups: GeoGroups, params: list[nn.Parameter], cfg: GeoConfig) -> None:
        self.groups, self.cfg = groups, cfg
        self.striped = 0
        """Inter-datacenter collectives this rank split over ``geo.wan_streams`` connections."""
        assert params, "a geo strategy needs at least one parameter"
        self.n_params = len(params)
        self.device = params[0].device
        """Where the flat buffers live (the parameters' device; gloo for CPU, NCCL for CUDA)."""
        self.bucket_numel = cfg.bucket_mb * 2**20 // 4
        self.bytes_sent: dict[str, int] = accounting.new_counter()
        """Bytes this rank has sent, by tier (intra_node, intra_dc, wan), since the run started."""

    # -- trainer hooks ---------------------------------------------------------------------------

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        raise NotImplementedError

    def after_optimizer_step(self, step: int, params: list[nn.Parameter]) -> None:
        """Called after each (inner) optimizer step; ``step`` is its 0-based index."""

    def params_agree_after(self, step: int) -> bool:
        """Whether every replica in every datacenter holds the same parameters after ``step``.

        True for the per-step strategies. Where it is False, a checkpoint must keep one model per
        datacenter (or per rank) to resume exactly.
        """
        return True

    def finish(self, params: list[nn.Parameter]) -> None:
        """Wait for and apply transfers still in flight (after the last step)."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's strategy state (rank-local: save one per rank)."""
        return {"kind": self.kind, "bytes_sent": dict(self.bytes_sent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise IsthmusError(f"geo checkpoint state is for sync {state.get('kind')!r}, this run uses {self.kind!r}")
        self.bytes_sent.update(state["bytes_sent"])

    # -- counted collectives -----------------------------------------------------------------------

    def _group(self, scope: Scope) -> dist.ProcessGroup:
        return {"world": self.groups.world_dp, "intra": self.groups.intra, "inter": self.groups.inter}[scope]

    def _count(self, scope: Scope, nbytes: int) -> None:
        tier = accounting.link_tier(self.groups, accounting.ring_next(self.groups, scope))
        self.bytes_sent[tier] += nbytes

    def _all_reduce(self, t: Tensor, scope: Scope, async_op: bool = False) -> Work:
        """Sum ``t`` in place over ``scope``."""
        n = accounting.scope_size(self.groups, scope)
        if n == 1:
            return _Done()
        self._count(scope, accounting.all_reduce_bytes(t.numel() * t.element_size(), n))
        if scope == "inter" and self.groups.inter_stripes:
            self.striped += 1
            return _finish(striped_all_reduce(t, self.groups.inter_stripes), async_op)
        work = dist.all_reduce(t, group=self._group(scope), async_op=async_op)
        return work if async_op else _Done()

    def _reduce_scatter(self, out: Tensor, inp: Tensor, scope: Scope) -> None:
        """``out`` = this rank's slice of the sum of ``inp`` over ``scope``."""
        n = accounting.scope_size(self.groups, scope)
        if n == 1:
            out.copy_(inp)
            return
        self._count(scope, accounting.reduce_scatter_bytes(inp.numel() * inp.element_size(), n))
        # torch 2.13 deprecates reduce_scatter_tensor for this name; gloo implements it on CPU.
        dist.reduce_scatter_single(out, inp, group=self._group(scope))

    def _all_gather(self, out: Tensor, inp: Tensor, scope: Scope, async_op: bool = False) -> Work:
        """``out`` = every rank's ``inp`` end to end, in group-rank order."""
        n = accounting.scope_size(self.groups, scope)
        if n == 1:
            out.copy_(inp)
            return _Done()
        self._count(scope, accounting.all_gather_bytes(out.numel() * out.element_size(), n))
        # torch 2.13 deprecates all_gather_into_tensor for this name; gloo implements it on CPU
        # for every dtype used here (fp32, uint8).
        if scope == "inter" and self.groups.inter_stripes:
            self.striped += 1
            return _finish(striped_all_gather(out, inp, self.groups.inter_stripes), async_op)
        work = dist.all_gather_single(out, inp, group=self._group(scope), async_op=async_op)
        return work if async_op else _Done()

    def _zeros(self, n: int) -> Tensor:
        return torch.zeros(n, dtype=torch.float32, device=self.device)

    def _check(self, params: list[nn.Parameter]) -> None:
        assert len(params) == self.n_params, f"built for {self.n_params} parameters, called with {len(params)}"


def _finish(work: StripedWork, async_op: bool) -> Work:
    """``work`` for the caller to wait on, or waited here when the call is synchronous."""
    if async_op:
        return work
    work.wait()
    return _Done()
