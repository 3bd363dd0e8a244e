"""A step's loss and byte counts, summed over every rank while the next step computes.

Each optimizer step ends with one all-reduce over the whole job: the loss (averaged over the ranks
that computed one: the last pipeline stage, every data/context-parallel rank) and the step's byte
counters (`GeoRun.step_counters`). Waited for at once, it is a barrier across the job every step;
across datacenters that is a WAN round trip or more per step, even under DiLoCo, whose inner steps
otherwise never touch the WAN (docs/benchmarks.md, the WAN pipeline benchmark). The trainer
starts it asynchronously and collects step k's sum after step k+1 has computed, so the sum crosses
the network behind a step's compute; before validation, a checkpoint or the last step it waits at
once. torch.distributed has no "reduce for the logs, eventually" of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from isthmus.train.hooks import Wait, wait_for


class StepSum:
    """One step's loss and counters, on their way through an all-reduce over every rank."""

    def __init__(self, local_loss: torch.Tensor | float | None, counters: Sequence[int], world: int) -> None:
        # float64: the byte counters stay exact below 2**53.
        self._value = torch.zeros(2 + len(counters), dtype=torch.float64)
        if local_loss is not None:
            self._value[0], self._value[1] = float(local_loss), 1.0
        if counters:
            self._value[2:] = torch.tensor(list(counters), dtype=torch.float64)
        self._work = dist.all_reduce(self._value, async_op=True) if world > 1 else None

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
