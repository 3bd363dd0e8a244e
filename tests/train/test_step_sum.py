"""A step's loss summed over ranks without holding up the next step (train/step_sum.py), on real gloo ranks."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from isthmus.train.step_sum import StepSum
from multirank import run_ranks


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def _sum_then_compute(flag_dir: str) -> tuple[float, list[int], float, list[int]]:
    """Rank 0 starts its step's sum, then "computes the next step" (signals rank 1, which starts its
    own sum only then): were starting the sum a barrier, rank 0 would never signal and both would hang.
    Then a second sum where only rank 1 has a loss (a pipeline's last stage)."""
    import torch.distributed as dist

    rank, flags = dist.get_rank(), Path(flag_dir)
    if rank == 0:
        pending = StepSum(torch.tensor(2.0), [10, 1], world=2)
        (flags / "rank0-computing").touch()
    else:
        _wait_for(flags / "rank0-computing")
        pending = StepSum(torch.tensor(4.0), [5, 2], world=2)
    loss, counters = pending.loss, pending.counters
    last_stage = StepSum(torch.tensor(7.5) if rank == 1 else None, [], world=2)
    return loss, counters, last_stage.loss, last_stage.counters


def test_a_step_sum_does_not_wait_for_the_other_ranks_to_start_it(tmp_path: Path) -> None:
    for loss, counters, last_loss, last_counters in run_ranks(_sum_then_compute, 2, str(tmp_path), timeout=120):
        assert loss == 3.0 and counters == [15, 3]  # mean loss, summed counters
        assert last_loss == 7.5 and last_counters == []  # the mean over the ranks that had a loss


def test_one_rank_sums_at_once() -> None:
    one = StepSum(torch.tensor(1.25), [7], world=1)
    assert one.wait() is one and one.loss == 1.25 and one.counters == [7]


class _Pending:
    """A sum that is in once ``arrived`` is set."""

    def __init__(self, eventually: bool, arrived: bool = False) -> None:
        self.eventually, self.arrived = eventually, arrived

    def done(self) -> bool:
        return self.arrived


def test_the_trainer_logs_a_job_wide_diloco_sum_once_it_is_in_and_in_step_order() -> None:
    from collections import deque
    from types import SimpleNamespace

    from isthmus.train.trainer import Trainer

    closed: list[int] = []
    trainer = SimpleNamespace(
        cfg=SimpleNamespace(geo=SimpleNamespace(inner_steps=3)),
        _close_step=lambda done, result, metrics: closed.append(done.step),
    )
    job = _Pending(eventually=True)
    steps = deque(SimpleNamespace(step=s, sum=p) for s, p in ((3, job), (4, _Pending(False)), (5, _Pending(False))))
    Trainer._close_due(trainer, steps, None, None)  # type: ignore[arg-type]
    assert closed == []  # the job-wide sum is on its way; the inner steps after it wait their turn
    job.arrived = True
    Trainer._close_due(trainer, steps, None, None)  # type: ignore[arg-type]
    assert closed == [3, 4, 5] and not steps
    late = _Pending(eventually=True)
    steps.extend(SimpleNamespace(step=s, sum=late if s == 6 else _Pending(False)) for s in range(6, 12))
    Trainer._close_due(trainer, steps, None, None)  # type: ignore[arg-type]
    assert closed[3:] == []  # in flight for the next round's steps too
    steps.append(SimpleNamespace(step=12, sum=_Pending(False)))
    Trainer._close_due(trainer, steps, None, None)  # type: ignore[arg-type]
    assert closed[3:] == [6, 7, 8, 9, 10, 11, 12]  # two outer rounds later it is waited for
