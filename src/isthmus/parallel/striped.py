"""Striped transfers: one tensor split over several connections (``geo.wan_streams``).

One TCP flow between datacenters is limited by its window: at tens of milliseconds of round trip
it carries window / RTT, far below the link. Gloo keeps one connection per pair of ranks per
process group, so ``n`` process groups over the same ranks give ``n`` connections; a tensor split
into ``n`` contiguous stripes, each sent on its own group at once, uses them all. The receiver
receives each stripe straight into its slice of the destination buffer: the result is the same
bytes, whatever ``n`` (exact reassembly, no arithmetic).

torch has no notion of this (a process group is one connection per pair, and
``batch_isend_irecv`` requires all ops of a batch on one group), so it is written here:

- :func:`stripe_stage` wraps a pipeline stage's four P2P op factories: an op whose peer is in
  another datacenter keeps its group (as the schedule's batching requires) but runs as ``n``
  asynchronous sends or receives on the stripe groups, and hands the schedule one work that waits
  for all of them;
- :func:`striped_all_reduce` / :func:`striped_all_gather`: the same for the collectives of a
  cross-datacenter sync (``geo.sync``) on its inter-datacenter group.

:func:`stripe_groups` makes the extra groups (a collective: every rank creates every group).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage  # (imports torch._dynamo: only pipelined runs do)


class StripedWork:
    """The works of one striped transfer, waited as one; ``then`` runs once, after the last."""

    def __init__(self, works: Sequence[Any], keep: Sequence[Tensor] = (), then: Callable[[], None] | None = None):
        self.works = list(works)
        self._keep = list(keep)  # stripes that must outlive the asynchronous sends reading them
        self._then = then

    def wait(self, timeout: Any = None) -> bool:
        for w in self.works:
            w.wait()
        if self._then is not None:
            then, self._then = self._then, None
            then()
        self._keep.clear()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def stripes(t: Tensor, n: int) -> list[Tensor]:
    """``t`` (contiguous) as ``n`` contiguous views of nearly equal size, empty ones left out; sender
    and receiver of the same shape cut the same stripes."""
    assert t.is_contiguous(), "stripes are views of a contiguous tensor"
    return [s for s in t.view(-1).tensor_split(n) if s.numel()]


def stripe_groups(rank_lists: Sequence[Sequence[int]], n: int) -> list[list[dist.ProcessGroup]]:
    """``n - 1`` more process groups over each rank list (stripe 0 is the group the caller has).
    Returns, per stripe 1..n-1, this rank's group (a non-member's entry is never used). A
    collective: every rank calls it with the same lists, in the same order."""
    rank = dist.get_rank()
    out: list[list[dist.ProcessGroup]] = []
    for _ in range(1, n):
        mine: list[dist.ProcessGroup] = []
        for ranks in rank_lists:
            group = dist.new_group(list(ranks))
            if rank in ranks:
                mine.append(group)
        out.append(mine)
    return out


def _peer_in(group: dist.ProcessGroup, global_rank: int) -> int:
    return dist.get_group_rank(group, global_rank)


def striped_send(t: Tensor, groups: Sequence[dist.ProcessGroup], global_peer: int) -> StripedWork:
    """Send ``t`` to ``global_peer`` as one stripe per group, all at once."""
    src = t.contiguous()
    parts = stripes(src, len(groups))
    works = [dist.isend(p, group=g, group_dst=_peer_in(g, global_peer)) for p, g in zip(parts, groups, strict=False)]
    return StripedWork(works, keep=[src, *parts])


def striped_recv(t: Tensor, groups: Sequence[dist.ProcessGroup], global_peer: int) -> StripedWork:
    """Receive into ``t`` (contiguous, as torch's pipeline buffers are) from ``global_peer``, stripe by stripe."""
    parts = stripes(t, len(groups))
    works = [dist.irecv(p, group=g, group_src=_peer_in(g, global_peer)) for p, g in zip(parts, groups, strict=False)]
    return StripedWork(works)


def stripe_stage(
    stage: PipelineStage,
    streams: Sequence[dist.ProcessGroup],
    crosses: Callable[[int], bool],
    counter: dict[str, int],
) -> None:
    """Make the P2P ops of ``stage`` toward a peer for which ``crosses(peer group rank)`` holds run
    striped over ``streams`` (the stage's own group first). The schedule still batches and waits
    them as it does any op; only what the op runs changes. ``counter["striped"]`` counts them."""
    group = stage.group
    assert group is not None and streams and streams[0] is group

    def striped(op: dist.P2POp) -> dist.P2POp:
        if not crosses(op.group_peer):
            return op
        move = striped_send if op.op is dist.isend else striped_recv
        peer = dist.get_global_rank(group, op.group_peer)

        # batch_isend_irecv and the schedule's _batch_p2p call op.op(tensor, group=, tag=, group_dst= or
        # group_src=); the P2POp keeps its own group so that a batch stays on one group.
        def run(tensor: Tensor, **_: Any) -> StripedWork:
            counter["striped"] += 1
            return move(tensor, streams, peer)

        op.op = run
        return op

    for name in ("get_fwd_send_ops", "get_fwd_recv_ops", "get_bwd_send_ops", "get_bwd_recv_ops"):
        factory = getattr(stage, name)

        def wrapped(chunk_id: int, _factory: Callable[[int], list[dist.P2POp]] = factory) -> list[dist.P2POp]:
            return [striped(op) for op in _factory(chunk_id)]

        setattr(stage, name, wrapped)


def striped_all_reduce(t: Tensor, groups: Sequence[dist.ProcessGroup]) -> StripedWork:
    """Sum ``t`` (contiguous) in place over the ranks of ``groups`` (the same ranks each), one stripe per group."""
    parts = stripes(t, len(groups))
    return StripedWork([dist.all_reduce(p, group=g, async_op=True) for p, g in zip(parts, groups, strict=False)])


def striped_all_gather(out: Tensor, inp: Tensor, groups: Sequence[dist.ProcessGroup]) -> StripedWork:
    """``out`` = every rank's ``inp`` end to end (group-rank order), gathered one stripe of ``inp``
    per group; each stripe's gather lands in a buffer of its own and is copied into place on wait."""
    n_ranks = dist.get_world_size(groups[0])
    parts = stripes(inp.contiguous(), len(groups))
    gathered = [torch.empty(n_ranks * p.numel(), dtype=p.dtype, device=p.device) for p in parts]
    works = [
        dist.all_gather_single(g_out, p, group=g, async_op=True)
        for g_out, p, g in zip(gathered, parts, groups, strict=False)
    ]
    rows = out.view(n_ranks, -1)

    def place() -> None:
        start = 0
        for g_out, p in zip(gathered, parts, strict=True):
            rows[:, start : start + p.numel()].copy_(g_out.view(n_ranks, -1))
            start += p.numel()

    return StripedWork(works, keep=parts, then=place)
