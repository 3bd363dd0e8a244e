"""AdamW with decoupled weight decay on matrices only, and a warm-up + cosine learning rate."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from isthmus.config import TrainConfig
from isthmus.train.zero1 import ShardedOptimizer


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
    return by_tensor_kind(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
    )


def by_tensor_kind(groups: list[dict]) -> list[dict]:
    """Each group split into its DTensor parameters and its plain ones (same settings), empty ones
    dropped: the fused kernel takes one list per group, and DTensor's dispatch refuses a list that
    mixes the two kinds, as tensor parallelism leaves them (sharded matrices, replicated norms)."""
    out = []
    for group in groups:
        params = list(group["params"])
        for kind in (True, False):
            mine = [p for p in params if isinstance(p, DTensor) is kind]
            if mine:
                out.append({**group, "params": mine})
    return out


def build_optimizer(
    modules: nn.Module | list[nn.Module],
    cfg: TrainConfig,
    zero1_group: ProcessGroup | None = None,
    shard_group: ProcessGroup | None = None,
) -> torch.optim.Optimizer:
    """AdamW over this rank's (local) parameters.

    ``fused=True``: torch's fused kernel (CPU and CUDA) updates a tensor in one pass over its
    parameter, gradient and two moments, where the single-tensor path (torch's default on CPU) makes
    about ten elementwise passes, an order of magnitude slower on CPU (dev/LOG.md). Like the
    single-tensor path it updates each element on its own, so a parameter
    whole or split into shards gets bit-identical updates (checked at shard boundaries that fall
    inside the kernel's vector lanes), which the layout-equivalence tests rely on; it differs from
    the single-tensor path by up to 5e-7 relative. With ``zero1_group`` (ZeRO-1) torch's
    ZeroRedundancyOptimizer keeps each rank's share of the AdamW state only and broadcasts the
    updated parameters. With ``shard_group`` (ZeRO-1 next to tp, pp, cp or replicas, over FSDP2's
    replicated DTensors) `isthmus.train.zero1.ShardedOptimizer` does the same over local tensors.
    """
    groups = param_groups(modules if isinstance(modules, list) else [modules], cfg.weight_decay)
    kwargs: dict[str, Any] = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, fused=True)
    if zero1_group is not None:
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, process_group=zero1_group, **kwargs)
    if shard_group is not None:
        return ShardedOptimizer(groups, shard_group, torch.optim.AdamW, **kwargs)
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
    """The schedule of ``cfg`` as it is now: a copy, so that capping ``train.steps`` afterwards (the
    short-run override) shortens the run, not the schedule."""
    frozen = dataclasses.replace(cfg)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, frozen))
