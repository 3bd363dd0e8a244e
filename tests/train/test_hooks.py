"""`StepHookList` (train/hooks.py): the order in which the trainer's step hooks run, without processes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from torch import nn

from isthmus.train.hooks import StepHookList, Wait


class Recorder:
    """A step hook that writes down each call, as ``<name>.<point>``."""

    def __init__(self, name: str, calls: list[str], metrics: dict[str, Any] | None = None) -> None:
        self.name, self.calls, self.metrics = name, calls, metrics or {}

    def begin_step(self, step: int) -> None:
        self.calls.append(f"{self.name}.begin {step}")

    @contextmanager
    def span(self, what: str) -> Iterator[None]:
        self.calls.append(f"{self.name}.enter {what}")
        try:
            yield
        finally:
            self.calls.append(f"{self.name}.exit {what}")

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        self.calls.append(f"{self.name}.reduce")

    def wait(self, work: Any, name: str, inner: Wait) -> None:
        self.calls.append(f"{self.name}.wait {name}")
        inner(work, name)
        self.calls.append(f"{self.name}.waited {name}")

    def after_optimizer_step(self, step: int, params: list[nn.Parameter]) -> None:
        self.calls.append(f"{self.name}.after {step}")

    def end_step(self, step: int) -> dict[str, Any]:
        self.calls.append(f"{self.name}.end {step}")
        return self.metrics

    def finish(self, params: list[nn.Parameter]) -> None:
        self.calls.append(f"{self.name}.finish")


class Work:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def wait(self) -> None:
        self.calls.append("work.wait")


def test_each_point_runs_the_hooks_in_wiring_order_and_finish_in_reverse() -> None:
    calls: list[str] = []
    hooks = StepHookList([Recorder("geo", calls), Recorder("bubbles", calls)])
    hooks.begin_step(1)
    with hooks.span("optimizer"):
        calls.append("optimizer.step")
    hooks.reduce_gradients([])
    hooks.after_optimizer_step(1, [])
    hooks.end_step(1)
    hooks.finish([])
    assert calls == [
        "geo.begin 1",
        "bubbles.begin 1",
        "geo.enter optimizer",
        "bubbles.enter optimizer",
        "optimizer.step",
        "bubbles.exit optimizer",
        "geo.exit optimizer",
        "geo.reduce",
        "bubbles.reduce",
        "geo.after 1",
        "bubbles.after 1",
        "geo.end 1",
        "bubbles.end 1",
        "bubbles.finish",  # wired last (it wraps what the geo run put on the pipeline): finished first
        "geo.finish",
    ]


def test_waits_nest_with_the_first_hook_outermost() -> None:
    calls: list[str] = []
    hooks = StepHookList([Recorder("geo", calls), Recorder("bubbles", calls)])
    hooks.wait(Work(calls), "all-reduce loss")
    assert calls == [
        "geo.wait all-reduce loss",
        "bubbles.wait all-reduce loss",
        "work.wait",
        "bubbles.waited all-reduce loss",
        "geo.waited all-reduce loss",
    ]


def test_no_hooks_wait_plainly_and_report_nothing() -> None:
    calls: list[str] = []
    hooks = StepHookList([])
    hooks.wait(Work(calls), "all-reduce grad norm")
    with hooks.span("forward+backward"):
        calls.append("forward+backward")
    hooks.finish([])
    assert calls == ["work.wait", "forward+backward"] and hooks.end_step(1) == {}


def test_step_metrics_keep_the_wiring_order() -> None:
    calls: list[str] = []
    geo = Recorder("geo", calls, {"dc_quorum": 2})
    bubbles = Recorder("bubbles", calls, {"busy": [0.5], "prefill_tokens": 8})
    assert list(StepHookList([geo, bubbles]).end_step(3)) == ["dc_quorum", "busy", "prefill_tokens"]


def test_a_span_exits_the_hooks_it_entered_when_the_op_fails() -> None:
    calls: list[str] = []
    hooks = StepHookList([Recorder("geo", calls), Recorder("bubbles", calls)])
    with pytest.raises(RuntimeError, match="out of memory"), hooks.span("forward+backward"):
        raise RuntimeError("out of memory")
    assert calls == [
        "geo.enter forward+backward",
        "bubbles.enter forward+backward",
        "bubbles.exit forward+backward",
        "geo.exit forward+backward",
    ]


def test_a_finish_that_fails_stops_the_ones_after_it() -> None:
    calls: list[str] = []

    class Failing(Recorder):
        def finish(self, params: list[nn.Parameter]) -> None:
            super().finish(params)
            raise OSError("disk full")

    hooks = StepHookList([Recorder("geo", calls), Failing("bubbles", calls)])
    with pytest.raises(OSError, match="disk full"):
        hooks.finish([])
    # The geo run's finish is a collective: run after a failure on this rank only, it would meet
    # another rank's different collective.
    assert calls == ["bubbles.finish"]
