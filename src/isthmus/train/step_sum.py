"""A step's loss and byte counts, summed over every rank while the next step computes.

Each optimizer step ends with one all-reduce over the whole job: the loss (averaged over the ranks
that computed one: the last pipeline stage, every data/context-parallel rank) and the step's byte
counters (`GeoRun.step_counters`). Waited for at once, it is a barrier across the job every step;
across datacenters that is a WAN round trip or more per step, even under DiLoCo, whose inner steps
otherwise never touch the WAN (docs/benchmarks.md, the WAN pipeline benchmark). The trainer
starts it asynchronously and collects step k's sum after step k+1 has computed, so the sum crosses
the network behind a step's compute; before validation, a checkpoint or the last step it waits at
once. torch.distributed has no "reduce for the logs, eventually" of its own.

Under DiLoCo (``geo.sync = diloco | streaming_diloco`` over several datacenters) the steps of one
outer round share one all-reduce instead (`RoundSum`), started at the round's last step: every
step's record is the same as above, logged once that sum is in, and no inner step waits on the WAN.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from isthmus.train.hooks import Wait, wait_for


class StepSum:
    """One step's loss and counters, on their way through an all-reduce over every rank."""

    eventually = False
    """Whether the trainer may leave this sum in flight for up to an outer round (`RoundStep`)."""

    def __init__(self, local_loss: torch.Tensor | float | None, counters: Sequence[int], world: int) -> None:
        self._value = _row(local_loss, counters)
        self._work = dist.all_reduce(self._value, async_op=True) if world > 1 else None

    def done(self) -> bool:
        """Whether the sum is in (never blocks)."""
        return self._work is None or bool(self._work.is_completed())

    def wait(self, wait: Wait = wait_for) -> StepSum:
        """Block until the sum is in (at most once), through ``wait`` (the trainer's step hooks,
        which may fill it); returns self."""
        if self._work is not None:
            wait(self._work, "all-reduce loss")  # stages without the loss wait here for the last one
            self._work = None
        return self

    @property
    def loss(self) -> float:
        """The mean loss over the ranks that computed one."""
        self.wait()
        return float(self._value[0] / self._value[1])

    @property
    def counters(self) -> list[int]:
        """The counters, summed over every rank."""
        self.wait()
        return [int(v) for v in self._value[2:].tolist()]


def _row(local_loss: torch.Tensor | float | None, counters: Sequence[int]) -> torch.Tensor:
    """[loss, 1 (or 0, 0 without a loss), counters...]; float64: the byte counters stay exact below 2**53."""
    value = torch.zeros(2 + len(counters), dtype=torch.float64)
    if local_loss is not None:
        value[0], value[1] = float(local_loss), 1.0
    if counters:
        value[2:] = torch.tensor(list(counters), dtype=torch.float64)
    return value


class RoundSum:
    """The losses and counters of the steps of one DiLoCo outer round, summed over every rank in
    one all-reduce once `start` is called (at the round's last step, or when the trainer needs the
    figures sooner: validation, a checkpoint; every rank reaches those at the same step)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._rows: list[torch.Tensor] = []
        self._value: torch.Tensor | None = None
        self._work: Any = None

    def add(self, local_loss: torch.Tensor | float | None, counters: Sequence[int]) -> RoundStep:
        """One more step of the round; its figures arrive with the round's."""
        assert self._value is None, "a round's sum took its steps already"
        self._rows.append(_row(local_loss, counters))
        return RoundStep(self, len(self._rows) - 1)

    @property
    def started(self) -> bool:
        return self._value is not None

    def start(self) -> None:
        """Start the all-reduce (once)."""
        if self._value is None:
            self._value = torch.stack(self._rows)
            self._work = dist.all_reduce(self._value, async_op=True) if self.world > 1 else None

    def done(self) -> bool:
        """Whether the sum is in (never blocks)."""
        return self.started and (self._work is None or bool(self._work.is_completed()))

    def wait(self, wait: Wait = wait_for) -> torch.Tensor:
        """Block until the sum is in (starting it if not yet started); the summed rows."""
        self.start()
        if self._work is not None:
            wait(self._work, "all-reduce the outer round's losses")
            self._work = None
        assert self._value is not None
        return self._value


class RoundStep:
    """One step of a `RoundSum`, read like a `StepSum`."""

    eventually = True

    def __init__(self, round_sum: RoundSum, index: int) -> None:
        self.round, self.index = round_sum, index

    def done(self) -> bool:
        return self.round.done()

    def wait(self, wait: Wait = wait_for) -> RoundStep:
        self.round.wait(wait)
        return self

    @property
    def loss(self) -> float:
        """The mean loss over the ranks that computed one."""
        row = self.round.wait()[self.index]
        return float(row[0] / row[1])

    @property
    def counters(self) -> list[int]:
        """The counters, summed over every rank."""
        return [int(v) for v in self.round.wait()[self.index, 2:].tolist()]
