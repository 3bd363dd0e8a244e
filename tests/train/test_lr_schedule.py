"""The learning-rate schedule follows ``train.steps`` as configured, even when a run is capped."""

from __future__ import annotations

import torch

from isthmus.config import TrainConfig
from isthmus.train.optim import build_lr_scheduler, lr_factor


def test_capping_train_steps_after_the_schedule_is_built_leaves_it_unchanged() -> None:
    cfg = TrainConfig(steps=100, warmup_steps=10)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_lr_scheduler(opt, cfg)
    cfg.steps = 20  # what ISTHMUS_MAX_STEPS does to a run after the scheduler exists
    lrs = []
    for _ in range(30):
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    expected = [lr_factor(s, TrainConfig(steps=100, warmup_steps=10)) for s in range(1, 31)]
    assert lrs == expected
    assert lrs[-1] > 0.5  # a 20-step schedule would have decayed to min_lr_ratio by step 20
