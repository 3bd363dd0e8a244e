"""The bubble filler's back-off (``parallel.bubbles.FillGuard``), on a fake clock.

A chunk starts only where its predicted cost fits in what the guard leaves of the slot's gap; an
overrun past a transfer's completion shrinks that slot's next budget; filled steps slower than the
unfilled probe steps halve the share of every gap filled, down to nothing.
"""

from __future__ import annotations

import threading
from collections import deque

import torch
from torch import nn

from isthmus.parallel.bubbles import OVERRUN_PENALTY, SLACK_S, BubbleFiller, FillGuard, Request, Timeline


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class CostlyModel(nn.Module):
    """Logits of zeros; each call moves the fake clock on by ``cost`` seconds."""

    def __init__(self, clock: FakeClock, cost: float) -> None:
        super().__init__()
        self.clock, self.cost, self.calls = clock, cost, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.t += self.cost
        self.calls += 1
        return torch.zeros(1, x.shape[1], 8)


class Work:
    """A transfer that completes when the test says so (``wait`` blocks the waiter thread)."""

    def __init__(self, done: bool = False) -> None:
        self.event = threading.Event()
        if done:
            self.event.set()

    def wait(self) -> bool:
        assert self.event.wait(30), "the fake transfer never completed"
        return True


def _filler(cost: float, gaps: dict[int, float], n: int = 50) -> tuple[BubbleFiller, CostlyModel]:
    clock = FakeClock()
    model = CostlyModel(clock, cost)
    filler = BubbleFiller(model, [Request(str(i), [1] * 32) for i in range(n)], torch.device("cpu"), Timeline())
    filler.clock = clock
    filler._costs[32] = deque([cost])  # as calibrate would have measured
    for slot, gap in gaps.items():
        filler._gaps[slot] = deque([gap, gap])
    filler.guard.begin_step(3, clock(), False)  # a filled step
    return filler, model


def test_a_gap_shorter_than_the_predicted_chunk_is_not_filled() -> None:
    filler, model = _filler(cost=0.010, gaps={0: 0.012})  # predicted 0.0125 s > 0.012 - slack
    filler.wait(Work(done=True), "recv")
    assert model.calls == 0 and len(filler.pending) == 50
    wait = filler.timeline.events[-1]
    assert wait.cat == "wait" and "budget_ms" not in wait.args  # not a filled wait


def test_chunks_stop_where_the_next_would_pass_the_budget() -> None:
    filler, model = _filler(cost=0.010, gaps={0: 0.100})
    work = Work()
    timer = threading.Timer(0.3, work.event.set)  # completes long after the chunks (clock is fake)
    timer.start()
    try:
        filler.wait(work, "recv")
    finally:
        timer.cancel()
    # 0.1 s less the slack leaves 0.0995 s: chunks of a predicted 0.0125 s start at 0, 0.01, ..., 0.08.
    assert model.calls == 9
    chunks = [e for e in filler.timeline.events if e.cat == "prefill"]
    wait = filler.timeline.events[-1]
    assert all(c.start + c.args["predicted_ms"] / 1e3 <= wait.start + 0.100 - SLACK_S + 1e-9 for c in chunks)
    assert wait.args["budget_ms"] == round((0.100 - SLACK_S) * 1e3, 3)


def test_an_overrun_shrinks_the_next_budget_and_clean_waits_restore_it() -> None:
    guard = FillGuard()
    guard.begin_step(3, 0.0, False)
    before = guard.budget(0, 0.100)
    guard.record(0, overrun=0.004, wake=None)
    assert guard.budget(0, 0.100) == before - OVERRUN_PENALTY * 0.004
    assert guard.budget(1, 0.100) == before  # other slots keep theirs
    guard.record(0, overrun=0.0, wake=0.0)
    assert guard.budget(0, 0.100) == before - OVERRUN_PENALTY * 0.002


def test_the_observed_wake_up_is_kept_free() -> None:
    guard = FillGuard()
    guard.begin_step(3, 0.0, False)
    before = guard.budget(0, 0.050)
    guard.record(0, overrun=0.0, wake=0.003)
    guard.record(0, overrun=0.0, wake=0.001)
    assert abs(guard.budget(0, 0.050) - (before - 0.003)) < 1e-12


def _steps(guard: FillGuard, filled_s: float, probe_s: float, n: int) -> list[bool]:
    """Run ``n`` steps, each taking ``filled_s`` when filled and ``probe_s`` when not; which were filled."""
    now, filled, out = 0.0, False, []
    for step in range(1, n + 1):
        guard.begin_step(step, now, filled)
        filled = guard.filling and step > 2  # steps 1-2 measure the gaps: nothing fits yet
        out.append(filled)
        now += filled_s if filled else probe_s
    return out


def test_filled_steps_slower_than_probes_back_off_to_nothing() -> None:
    guard = FillGuard(probe_every=4)
    filled = _steps(guard, filled_s=1.10, probe_s=1.00, n=40)
    assert guard.scale == 0.0 and not guard.filling
    assert not any(filled[-8:])  # given up: nothing filled at the end
    assert sum(filled) <= 10


def test_filling_that_costs_nothing_keeps_the_whole_gap() -> None:
    guard = FillGuard(probe_every=4)
    filled = _steps(guard, filled_s=1.005, probe_s=1.00, n=40)  # within the 2% tolerance
    assert guard.scale == 1.0
    assert sum(filled) == 40 - 2 - 10  # all but steps 1-2 and every fourth (the probes)


def test_a_budget_is_nothing_on_a_probe_step() -> None:
    guard = FillGuard(probe_every=4)
    guard.begin_step(4, 0.0, False)
    assert guard.budget(0, 1.0) == 0.0
