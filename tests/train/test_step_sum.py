"""A step's loss summed over ranks without holding up the next step (train/step_sum.py), on real gloo ranks."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
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


def _diloco_trainer(monkeypatch: pytest.MonkeyPatch, per_round: bool = True) -> tuple[Any, list[tuple[int, ...]]]:
    """A stand-in trainer of a DiLoCo run over 2 datacenters of 2 ranks (H = 3), and the shape of
    each all-reduce its step sums started (no process group: they are recorded only)."""
    import isthmus.train.step_sum as step_sum

    shapes: list[tuple[int, ...]] = []
    monkeypatch.setattr(step_sum.dist, "all_reduce", lambda t, async_op=False: shapes.append(tuple(t.shape)))
    counts = iter(range(10, 1000, 10))
    geo_run = SimpleNamespace(sums_per_round=per_round, step_counters=lambda: [0, 0, next(counts)])
    trainer = SimpleNamespace(
        geo_run=geo_run, world=4, step=0, _round=None, cfg=SimpleNamespace(geo=SimpleNamespace(inner_steps=3))
    )
    return trainer, shapes


def _take(trainer: Any, last: bool = False) -> Any:
    from isthmus.train.trainer import Trainer

    trainer.step += 1
    return Trainer._step_sum(trainer, None, last)


def test_diloco_inner_steps_start_no_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, shapes = _diloco_trainer(monkeypatch)
    sums = []
    for step in range(1, 8):
        sums.append(_take(trainer, last=step == 7))
        # One all-reduce per outer round (steps 3 and 6) and one for the run's last step, each
        # carrying its steps' rows: [loss, has a loss, 3 byte tiers].
        assert len(shapes) == (step >= 3) + (step >= 6) + (step >= 7)
    assert shapes == [(3, 5), (3, 5), (1, 5)] and all(s.eventually for s in sums)
    assert [s.counters[-1] for s in sums] == [10 * step for step in range(1, 8)]  # per step, as before


def test_a_diloco_round_is_summed_early_when_the_trainer_needs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, shapes = _diloco_trainer(monkeypatch)
    _take(trainer).wait()  # validation or a checkpoint after step 1: every rank starts the round's sum there
    _take(trainer)
    _take(trainer)
    assert shapes == [(1, 5), (2, 5)]


def test_without_diloco_every_step_is_summed_on_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, shapes = _diloco_trainer(monkeypatch, per_round=False)
    sums = [_take(trainer) for _ in range(3)]
    assert shapes == [(5,), (5,), (5,)] and not any(s.eventually for s in sums)


def _inner_steps_without_the_other_datacenter(flag_dir: str) -> list[float]:
    """Two datacenters of one rank each: rank 0 takes two inner steps before rank 1 starts its
    first; were an inner step's sum to cross the WAN, rank 0 would wait forever."""
    import torch.distributed as dist

    from isthmus.config import GeoConfig
    from isthmus.geo.run import GeoRun
    from isthmus.layout.dims import ParallelDims
    from isthmus.train.trainer import Trainer

    rank, flag = dist.get_rank(), Path(flag_dir) / "rank0-inner-done"
    run = GeoRun(GeoConfig(datacenters=2, sync="diloco", inner_steps=3, outer_dtype="fp32"))
    run.build_sync([torch.nn.Parameter(torch.ones(4))], ParallelDims(1, 1, 1, 1, 1, world_size=2, datacenters=2), 2)
    trainer = SimpleNamespace(geo_run=run, world=2, step=0, _round=None, cfg=SimpleNamespace(geo=run.cfg))
    if rank == 1:
        _wait_for(flag)
    sums = []
    for step in (1, 2, 3):  # step 3 ends the outer round
        if step == 3:
            flag.touch()
        trainer.step = step
        sums.append(Trainer._step_sum(trainer, torch.tensor(float(rank + step)), False))  # type: ignore[arg-type]
    return [s.loss for s in sums]


@pytest.mark.slow
def test_diloco_inner_steps_never_wait_for_the_other_datacenter(tmp_path: Path) -> None:
    for losses in run_ranks(_inner_steps_without_the_other_datacenter, 2, str(tmp_path), timeout=120):
        assert losses == [1.5, 2.5, 3.5]  # each step's mean over both datacenters, as without DiLoCo
