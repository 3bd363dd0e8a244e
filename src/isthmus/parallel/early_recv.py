"""Receives posted ahead (``geo.pp_early_recv``): a pipeline's cross-datacenter receives of a whole
step posted when the step's first one is asked for, instead of each when the schedule reaches it.

Why it matters on a WAN. Gloo's TCP transport is receiver-driven: a send's payload enters the
connection only once the receiver has posted the matching receive (``Pair::send`` writes against a
remote pending receive; otherwise it announces itself and waits for the receiver's notice). A
receive posted when the schedule needs its tensor therefore costs a full round trip on top of the
transfer: the notice travels to the sender, then the payload travels back. torch's schedules post
each receive just before they wait for it, so every crossing of a WAN boundary pays an RTT, which
is what made a pipeline across 80 ms several times slower than the wire time explains. Posted
ahead, the notices cross while the sender still computes, and a payload leaves as soon as it is sent.

What is posted. For each local stage, each of the two receive kinds (activations from the previous
stage, gradients from the next) whose peer is in another datacenter: the ops of every micro-batch of
the step, from the stage's own factories (with whatever striping and compression wrap them), into
torch's per-micro-batch receive buffers. A later request for micro-batch ``k``'s ops gets ops whose
``op.op`` hands back the work already in flight. Gloo matches receives of one pair and tag in
posting order, and a stage's sender sends its micro-batches in increasing order, so receive ``k``
gets micro-batch ``k``. Nothing else uses those pairs in that direction during a training step
(evaluation runs between steps, and every receive posted here completes within its step), which is
why it is limited to one stage per rank: two local stages could receive from the same peer rank on
one tag (interleaved schedules), where posting order would no longer identify the micro-batch.

The bytes moved and the arithmetic are unchanged: results are bit-identical to receives posted on use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage  # (imports torch._dynamo: only pipelined runs do)


class _Posted:
    """A step's receives of one stage and kind, posted together; handed out one micro-batch at a time."""

    def __init__(self, factory: Callable[[int], list[dist.P2POp]], microbatches: int, crosses: Callable[[int], bool]):
        self._factory = factory
        self._microbatches = microbatches
        self._crosses = crosses
        self._ready: dict[int, list[dist.P2POp]] = {}
        self.posted = 0
        """Receives posted ahead over the run (a test reads it)."""

    def ops(self, chunk_id: int) -> list[dist.P2POp]:
        if not self._ready:
            if chunk_id != 0:  # a schedule that starts elsewhere: leave it alone (posting order = micro-batch order)
                return self._factory(chunk_id)
            for k in range(self._microbatches):
                self._ready[k] = [self._post(op) for op in self._factory(k)]
        return self._ready.pop(chunk_id)

    def _post(self, op: dist.P2POp) -> dist.P2POp:
        """``op`` started now if it crosses, made to hand its work to the schedule; else as it was."""
        if self._crosses(op.group_peer):
            self.posted += 1
            op.op = _handing(op.op(op.tensor, group=op.group, tag=op.tag, group_src=op.group_peer))
        return op

    def idle(self) -> bool:
        return not self._ready


def _handing(work: Any) -> Callable[..., Any]:
    def run(*_: Any, **__: Any) -> Any:
        return work

    return run


class EarlyRecv:
    """The receive kinds of this rank's stages posted ahead; :meth:`check` after each step."""

    def __init__(self, microbatches: int) -> None:
        self.microbatches = microbatches
        self.kinds: list[_Posted] = []

    def wrap_stage(self, stage: PipelineStage, crosses: Callable[[int], bool]) -> None:
        """Post the receives of ``stage`` from a peer for which ``crosses(peer group rank)`` holds ahead."""
        for name in ("get_fwd_recv_ops", "get_bwd_recv_ops"):
            posted = _Posted(getattr(stage, name), self.microbatches, crosses)
            self.kinds.append(posted)
            setattr(stage, name, posted.ops)

    @property
    def posted(self) -> int:
        return sum(k.posted for k in self.kinds)

    def check(self) -> None:
        """Every receive posted in the step was handed to the schedule (none outlives its step)."""
        assert all(k.idle() for k in self.kinds), "a step ended with receives posted ahead and never used"
