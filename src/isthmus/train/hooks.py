"""`StepHooks`: how an optional part of a run joins each optimizer step, without the step naming it.

The trainer's step is the same for every run: batch, forward/backward, reduce, clip, optimizer step.
What only some runs do plugs in here: the cross-datacenter strategy (`isthmus.geo.run.GeoRun`,
which reduces gradients and syncs after each step) and the busy/idle timeline with bubble filling
(`isthmus.serve.prefill.BubbleRun`, which times the step's ops and serves prefill while the step
waits for a collective). The trainer holds one `StepHookList` of them, in the order they were
wired; a part that has nothing to do at a point does nothing there.

Every hook method but ``span`` and ``wait`` may be a collective: every rank calls it at the same
point of the same step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from functools import partial
from typing import Any, Protocol

from torch import nn

Wait = Callable[[Any, str], None]
"""Waits for a collective's work; the ``str`` names the collective (for the timeline)."""


def wait_for(work: Any, name: str) -> None:
    """The plain wait: block until ``work`` is done."""
    work.wait()


class StepHooks(Protocol):
    """What an optional part of a run does at fixed points of each optimizer step.

    ``step`` is the step's number, 1 for the first step of the run.
    """

    def begin_step(self, step: int) -> None:
        """Before the step reads its batch."""

    def span(self, what: str) -> AbstractContextManager[Any]:
        """Around one of the step's ops: ``forward+backward`` (one micro-batch) or ``optimizer``."""
        ...

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        """After backward, before clipping: reduce what data parallelism did not reduce in backward."""

    def wait(self, work: Any, name: str, inner: Wait) -> None:
        """Wait for one of the step's collectives (``name``) by calling ``inner``, or in its place."""

    def after_optimizer_step(self, step: int, params: list[nn.Parameter]) -> None:
        """After the optimizer and the learning-rate schedule stepped."""

    def end_step(self, step: int) -> dict[str, Any]:
        """After the step: the step's own metrics, taken now (not when its loss arrives)."""
        ...

    def finish(self, params: list[nn.Parameter]) -> None:
        """After the last step (not after a failed one: a rank that failed calls no collective)."""


class StepHookList:
    """Several `StepHooks` as one, in wiring order: each point calls them first to last, except
    `finish`, which goes last to first (a part wired later may rest on an earlier one, as bubble
    filling wraps the pipeline hooks the geo run put on the stages, so it is finished first)."""

    def __init__(self, hooks: Sequence[StepHooks]) -> None:
        self.hooks = list(hooks)

    def begin_step(self, step: int) -> None:
        for h in self.hooks:
            h.begin_step(step)

    @contextmanager
    def span(self, what: str) -> Iterator[None]:
        with ExitStack() as stack:
            for h in self.hooks:
                stack.enter_context(h.span(what))
            yield

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        for h in self.hooks:
            h.reduce_gradients(params)

    def wait(self, work: Any, name: str, inner: Wait = wait_for) -> None:
        """The first hook's wait is outermost; the last one's calls ``inner``."""
        for h in reversed(self.hooks):
            inner = partial(h.wait, inner=inner)
        inner(work, name)

    def after_optimizer_step(self, step: int, params: list[nn.Parameter]) -> None:
        for h in self.hooks:
            h.after_optimizer_step(step, params)

    def end_step(self, step: int) -> dict[str, Any]:
        """Every hook's metrics, in wiring order (the order of their keys in the metrics records)."""
        out: dict[str, Any] = {}
        for h in self.hooks:
            out.update(h.end_step(step))
        return out

    def finish(self, params: list[nn.Parameter]) -> None:
        """Last to first. One that raises stops the rest: the others' collectives would meet another
        rank's different collective."""
        for h in reversed(self.hooks):
            h.finish(params)
