"""AdamW with decoupled weight decay on matrices only, and a warm-up + cosine learning rate."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.optim import ZeroRedundancyOptimizer

from isthmus.config import TrainConfig


def param_groups(modules: list[nn.Module], weight_decay: float) -> list[dict]:
    """Decay matrices of linear layers; leave norms and embeddings undecayed (as GPT-2/Llama recipes do)."""
    decay, no_decay = [], []
    seen: set[int] = set()
    named = [item for m in modules for item in m.named_parameters()]
    for name, p in named:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        # Tied output/embedding weights appear once, under the embedding's name: no decay.
        if p.ndim < 2 or "tok_embeddings" in name or "norm" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    modules: nn.Module | list[nn.Module], cfg: TrainConfig, zero1_group: ProcessGroup | None = None
) -> torch.optim.Optimizer:
    """AdamW over this rank's (local) parameters.

    ``foreach=False``: the single-tensor path gives bit-identical updates whether a parameter is
    whole or a shard of one, which the layout-equivalence tests rely on. With ``zero1_group``
    (ZeRO-1) torch's ZeroRedundancyOptimizer keeps each rank's share of the AdamW state only and
    broadcasts the updated parameters.
    """
    groups = param_groups(modules if isinstance(modules, list) else [modules], cfg.weight_decay)
    kwargs: dict[str, Any] = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, foreach=False)
    if zero1_group is not None:
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, process_group=zero1_group, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of train.lr at optimizer step ``step`` (0-based): linear warm-up, then cosine to min_lr_ratio."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
