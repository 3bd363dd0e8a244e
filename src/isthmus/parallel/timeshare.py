"""Time-shared WAN slots (``geo.wan_schedule = time_shared``): the data-parallel pipelines that
cross one WAN link at a stage boundary take the link in turn instead of all at once.

With fair sharing, k pipelines that reach a stage boundary together split the link: each transfer
takes k times as long and the pipelines stall together. Atlas (arXiv 2411.14458) gives the link to
one pipeline's transfer at a time, in replica order, which staggers the pipelines by one transfer so
that one computes while another transfers.

Who holds the turn. A send completing proves nothing (its bytes may still sit in the socket buffer
or the link's queue), but gloo's TCP transport writes a send's payload only once the receiver has
posted the matching receive (the receiver notifies the sender; ``Pair::send`` executes only
against a remote pending receive), so the *receiver* decides when bytes enter the link, and a
receive completing means they crossed it. The receivers of one boundary and direction all sit in
one datacenter, so they pass a token over a LAN group: replica r posts its k-th receive of a step
once replica r - 1 finished its k-th (replica 0: once the last replica finished its (k-1)-th), and
passes the token on when its own receive completes. The receive is therefore posted when the
schedule waits for it, not when the schedule batches it.

Why it cannot deadlock. Posting a receive late would hang a schedule that waits for a send before
the receive of the same batch (torch's 1F1B waits ``[bwd_send, fwd_recv]`` in that order on both
sides of a boundary), so a cross-datacenter send's wait returns at once and the send is waited
after the step (:meth:`Turns.flush`); its tensors stay referenced until then. With sends never
blocking, a rank only blocks on a receive, and a receive waits for (a) its sender to reach the send
(an earlier point of the same pipeline's program) and (b) the token, which comes from the same
receive of an earlier replica or an earlier receive of the last one. Every pipeline runs the same
program, so ordering events by (position in one pipeline's program, replica) makes every wait point
backwards: no cycle. The bytes moved are unchanged (bit-identical results to fair sharing), and
each turn is the whole transfer whatever :mod:`isthmus.parallel.striped` does inside it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage  # (imports torch._dynamo: only pipelined runs do)


class Turns:
    """One boundary-and-direction's token among the receivers of ``group`` (this rank is
    ``group`` rank ``replica``): ``per_step`` receives per replica per training step."""

    def __init__(self, group: dist.ProcessGroup, per_step: int, tag: int, pending: list[Any]) -> None:
        self.group = group
        self.replica = dist.get_rank(group)
        self.replicas = dist.get_world_size(group)
        self.per_step = per_step
        self.tag = tag
        self.count = 0
        self.held: list[tuple[float, float]] = []
        """(wall-clock seconds) each receive of this rank was posted and completed: when it held the link."""
        self._pending = pending  # token sends in flight, shared with the stage's send works
        self._token = torch.zeros(1, dtype=torch.uint8)

    def take(self) -> None:
        """Block until this replica's receive may start."""
        k = self.count % self.per_step
        if self.replica > 0 or k > 0:
            dist.recv(self._token, group=self.group, group_src=(self.replica - 1) % self.replicas, tag=self.tag)

    def pass_on(self) -> None:
        """This replica's receive completed: the next replica's may start."""
        k = self.count % self.per_step
        self.count += 1
        if self.replica < self.replicas - 1 or k < self.per_step - 1:
            token = torch.zeros(1, dtype=torch.uint8)
            work = dist.isend(token, group=self.group, group_dst=(self.replica + 1) % self.replicas, tag=self.tag)
            self._pending.append((work, token))


class _TurnRecv:
    """A receive posted on its turn, when the schedule waits for it."""

    def __init__(self, start: Callable[[], Any], turns: Turns) -> None:
        self._start = start
        self._turns = turns
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            self._turns.take()
            posted = time.time()
            self._start().wait()
            self._turns.held.append((posted, time.time()))
            self._turns.pass_on()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


class _DeferredSend:
    """A send whose wait is left to :meth:`TimeShare.flush` (see the module docstring)."""

    def __init__(self, work: Any, tensor: torch.Tensor, pending: list[Any]) -> None:
        pending.append((work, tensor))  # the tensor must outlive the send

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class TimeShare:
    """The time-shared cross-datacenter transfers of this rank's stages; ``flush`` after each step."""

    def __init__(self, group: dist.ProcessGroup, microbatches: int) -> None:
        self.group = group
        self.microbatches = microbatches
        self.pending: list[Any] = []  # (work, kept tensor) of deferred data sends and token sends
        self.turns: list[Turns] = []

    def wrap_stage(self, stage: PipelineStage, crosses: Callable[[int], bool]) -> None:
        """Make the P2P ops of ``stage`` toward a peer for which ``crosses(peer group rank)`` holds
        run in turn: receives on the token, sends without blocking the schedule."""
        channels = {
            "get_fwd_recv_ops": Turns(self.group, self.microbatches, 2 * stage.stage_index, self.pending),
            "get_bwd_recv_ops": Turns(self.group, self.microbatches, 2 * stage.stage_index + 1, self.pending),
        }
        self.turns.extend(channels.values())
        for name in ("get_fwd_send_ops", "get_fwd_recv_ops", "get_bwd_send_ops", "get_bwd_recv_ops"):
            factory = getattr(stage, name)
            turns = channels.get(name)

            def wrapped(
                chunk_id: int, _factory: Callable[[int], list[dist.P2POp]] = factory, _turns: Turns | None = turns
            ) -> list[dist.P2POp]:
                ops = _factory(chunk_id)
                crossing = [op for op in ops if crosses(op.group_peer)]
                # One tensor crosses per chunk (a block's activation or its gradient): one turn each.
                assert len(crossing) <= 1, "a time-shared boundary moves one tensor per microbatch"
                for op in crossing:
                    op.op = self._in_turn(op, _turns) if _turns is not None else self._deferred(op)
                return ops

            setattr(stage, name, wrapped)

    # batch_isend_irecv names the peer group_dst or group_src by whether op.op *is* dist.isend, which
    # a wrapped op is not: the wrappers call what the op ran before with the peer named by its kind.
    def _in_turn(self, op: dist.P2POp, turns: Turns) -> Callable[..., _TurnRecv]:
        run, peer = op.op, op.group_peer

        def recv(tensor: torch.Tensor, group: Any = None, tag: int = 0, **_: Any) -> _TurnRecv:
            return _TurnRecv(lambda: run(tensor, group=group, tag=tag, group_src=peer), turns)

        return recv

    def _deferred(self, op: dist.P2POp) -> Callable[..., _DeferredSend]:
        run, peer = op.op, op.group_peer

        def send(tensor: torch.Tensor, group: Any = None, tag: int = 0, **_: Any) -> _DeferredSend:
            return _DeferredSend(run(tensor, group=group, tag=tag, group_dst=peer), tensor, self.pending)

        return send

    def flush(self) -> None:
        """Wait for the step's cross-datacenter sends and token sends (their receivers post them
        during the same step, so this ends); check every turn of the step was taken."""
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
        assert all(t.count % t.per_step == 0 for t in self.turns), "a step ended between two turns"


def turn_groups(rank_lists: list[list[int]]) -> dist.ProcessGroup | None:
    """One group per list (a collective: every rank makes every group, in the same order); this
    rank's, or None."""
    rank = dist.get_rank()
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine
