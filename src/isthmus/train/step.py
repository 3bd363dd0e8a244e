"""What one local batch costs a rank, whatever its layout: shard, forward, loss, backward.

Shared by the trainer and by `isthmus.api` for people with their own loop, so both run the
same code for every layout.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel

from isthmus.models.moe import aux_loss_term
from isthmus.parallel.context import cp_shard
from isthmus.parallel.parallelize import ParallelModel
from isthmus.parallel.pipeline import pipeline_step
from isthmus.parallel.tp import is_vocab_sharded, vocab_parallel_cross_entropy

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss; fp32 logits so bf16 runs reduce in full precision. The vocab-sharded
    logits of tensor parallelism's head take the vocab-parallel form (`isthmus.parallel.tp`)."""
    if is_vocab_sharded(logits):
        return vocab_parallel_cross_entropy(logits, targets)  # type: ignore[arg-type]
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))


def loss_function(compiled: bool, loss_parallel: bool) -> LossFn:
    """The trainer's loss: `cross_entropy`, compiled under ``train.compile`` (the cast, log-softmax and
    gather fused by inductor), except where tensor parallelism leaves vocab-sharded logits: their
    loss has its collectives inside and runs eager."""
    if compiled and not loss_parallel:
        return torch.compile(cross_entropy)
    return cross_entropy


def loss_context(pm: ParallelModel) -> AbstractContextManager[Any]:
    """Tensor parallelism leaves vocab-sharded logits; a loss of one's own (`isthmus.api`) written
    with torch's ops on them needs torch's loss-parallel context around it and its backward
    (`cross_entropy` here needs none); a no-op for every other layout."""
    if pm.loss_parallel:
        return loss_parallel()
    return nullcontext()


def shard_batch(
    pm: ParallelModel, inputs: torch.Tensor, targets: torch.Tensor, cp_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's load-balanced sequence chunks under context parallelism; the batch otherwise."""
    if not pm.dims.cp_enabled:
        return inputs, targets

    cp = pm.dims.cp
    return cp_shard(inputs, 1, cp_rank, cp), cp_shard(targets, 1, cp_rank, cp)


def forward_backward(
    pm: ParallelModel,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_scale: float = 1.0,
    loss_fn: LossFn = cross_entropy,
) -> torch.Tensor | None:
    """Forward and backward of one local batch; gradients accumulate in ``.grad``.

    Returns the detached, unscaled loss (its mean over micro-batches under pp), or None on a
    pipeline rank without the last stage. A MoE model's auxiliary load-balancing loss joins the loss
    that is backpropagated (under pp each MoE layer feeds its own), not the one returned. ``loss_scale`` multiplies the loss before backward
    (1/accum for gradient accumulation). Under pp the schedule computes the loss with the
    ``loss_fn`` it was built with and averages over its own micro-batches; it cannot scale one
    call's contribution alone, so ``loss_scale`` must be 1 and the caller scales the accumulated
    gradients once at the end.
    """
    with loss_context(pm):
        if pm.schedule is not None:
            assert loss_scale == 1.0, "under pp, scale the accumulated gradients after the last call"
            return pipeline_step(pm.schedule, inputs, targets, pm.has_first_stage, pm.has_last_stage)
        loss = loss_fn(pm.model(inputs), targets)
        aux = aux_loss_term(pm.moe)
        total = loss if aux is None else loss + aux
        (total * loss_scale if loss_scale != 1.0 else total).backward()
        return loss.detach()
