"""Mixture-of-Experts feed-forward: a top-k router, SwiGLU experts, optional shared experts.

The layer follows torchtitan's MoE (and keeps its parameter layout, so its expert-parallel plan
applies): the router scores in fp32, each token picks its ``top_k`` experts, the token copies are
sorted by expert and run expert by expert (:class:`GroupedExperts`, the seam expert parallelism
wraps), then weighted by their scores and summed back per token.

Two choices make the layer a function of each sequence alone, so that any split of a batch into
ranks or micro-batches (data, expert and pipeline parallelism, gradient accumulation) computes
exactly what one process computes on the whole batch:

- the auxiliary load-balancing loss is Switch's ``n_experts * sum_e f_e * P_e`` per sequence,
  averaged over the sequences (DeepSeek-V3's sequence-wise balance loss); a batch-level ``f_e``
  would change with the batch each rank happens to see;
- with a capacity factor, the capacity is per sequence: expert ``e`` keeps at most
  ``ceil(capacity_factor * seq_len * top_k / n_experts)`` of a sequence's tokens, the earliest
  ones, so whether a token is dropped depends only on the tokens before it (the layer stays causal).
  Summed over a batch this is the usual bound ``capacity_factor * tokens * top_k / n_experts``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from isthmus.models.args import ModelArgs
from isthmus.models.ffn import FeedForward


def _local(t: Tensor) -> Tensor:
    """The local shard of a DTensor parameter (expert parallelism shards experts by expert)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _in_backward() -> bool:
    """Whether autograd is running a backward pass (activation checkpointing re-runs forwards there)."""
    return torch._C._current_graph_task_id() != -1


class _ScaleGrad(torch.autograd.Function):
    """The identity whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


class _AuxLossGrad(torch.autograd.Function):
    """The identity on a layer's output that, in backward, also gives the layer's auxiliary loss the
    gradient ``scale`` (d loss / d aux): the aux loss joins the training loss without being added to
    it, as a pipeline stage needs, whose loss is computed on another rank (Megatron's
    MoEAuxLossAutoScaler does the same)."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, aux: Tensor, scale: float) -> Tensor:
        ctx.scale, ctx.aux_meta = scale, (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


@dataclass
class ExpertLoad:
    """What one MoE layer saw since it was last asked (`MoE.take_load`): this rank's forwards."""

    tokens: Tensor
    """Token copies that chose each expert [n_experts] (before any capacity drop)."""
    dropped: Tensor
    """Copies dropped over capacity (a scalar)."""
    aux_loss_sum: Tensor
    """Sum of the forwards' auxiliary losses (a scalar; 0 unless load_balance is aux_loss)."""
    forwards: int
    """Forwards counted (micro-batches)."""


class Router(nn.Module):
    """Scores each token against every expert and picks its ``top_k``.

    ``expert_bias`` (the bias method's per-expert offsets) is added to the scores to choose the
    experts only: the weights the outputs are mixed with are the unbiased scores.
    """

    def __init__(self, dim: int, n_experts: int, top_k: int, score: str, norm_topk: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.expert_bias = nn.Parameter(torch.zeros(n_experts), requires_grad=False)
        self.top_k = top_k
        self.score = score
        self.norm_topk = norm_topk
        self.weight_grad_sum: Callable[[Tensor], Tensor] | None = None
        """Applied to the gate's weight in forward: tensor parallelism's sum of its gradient over the group."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """From x [..., dim]: (top-k weights [..., k] fp32, expert ids [..., k] int64, scores [..., E] fp32)."""
        weight = self.gate.weight if self.weight_grad_sum is None else self.weight_grad_sum(self.gate.weight)
        # fp32 on purpose: in bf16 close scores tie, and the chosen experts flip with rounding.
        logits = F.linear(x.float(), weight.float())
        scores = logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()
        selection = scores + self.expert_bias.float()
        experts = selection.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights, experts, scores


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU MLPs stored as stacked weights w1, w3 [E, ffn, dim] and w2 [E, dim, ffn].

    A loop over experts: ``torch._grouped_mm`` runs forward and backward on CPU fp32 in torch 2.13 and
    gives the same bits, but it is a private op, fails on stride-0 gradients there, and was only
    16% faster at moe-small's shape, so the plain loop stays.
    """

    def __init__(self, dim: int, ffn_dim: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.grad_scale = 1.0
        """Multiplies the weights' gradients: expert parallelism's 1/ep (see `isthmus.parallel.expert`)."""

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """Rows of x [T, dim], sorted by expert (``counts[e]`` rows for local expert e), each through its expert."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        if self.grad_scale != 1.0:
            w1, w2, w3 = (_ScaleGrad.apply(w, self.grad_scale) for w in (w1, w2, w3))
        splits = counts.tolist()
        assert len(splits) == w1.shape[0] and sum(splits) == x.shape[0], (splits, w1.shape, x.shape)
        # unbind, not w1[e]: its backward stacks the E gradients once instead of adding E full-size zeros.
        outs = [
            (F.silu(xe @ a.t()) * (xe @ c.t())) @ b.t()
            for xe, a, b, c in zip(x.split(splits), w1.unbind(0), w2.unbind(0), w3.unbind(0), strict=True)
        ]
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


class MoE(nn.Module):
    """Routed experts plus optional shared experts, in place of a block's FeedForward.

    After each training forward it keeps ``tokens_per_expert`` (tokens that chose each expert, summed
    over forwards until `take_load` reads them), ``tokens_dropped`` (copies over capacity, likewise) and
    ``aux_loss`` (this forward's load-balancing loss, with its graph; None unless
    ``load_balance == "aux_loss"``). Whoever trains adds ``aux_weight * aux_loss`` of every layer to
    the loss (`aux_loss_term`: ``aux_loss_coef`` times the mean over the layers); or, with
    ``feeds_aux_grad`` (pipeline stages, whose loss is on another rank), the layer gives its aux loss
    that gradient itself.
    """

    def __init__(self, args: ModelArgs, layer_id: int = 0) -> None:
        super().__init__()
        self.layer_id = layer_id
        """The block this layer belongs to."""
        self.n_experts = args.n_experts
        self.top_k = args.top_k
        self.capacity_factor = args.capacity_factor
        self.load_balance = args.load_balance
        self.router = Router(args.dim, args.n_experts, args.top_k, args.router_score, args.router_norm_topk)
        self.experts = GroupedExperts(args.dim, args.expert_ffn_dim, args.n_experts)
        width = args.n_shared_experts * args.expert_ffn_dim
        self.shared: FeedForward | None = FeedForward(args.dim, width, "swiglu") if width else None
        self.tokens_per_expert: Tensor | None = None
        self.tokens_dropped: Tensor | None = None
        self.aux_loss: Tensor | None = None
        self.aux_weight = args.aux_loss_coef / args.n_moe_layers
        self.counting = True
        """Whether training forwards add to the counts (off while a pipeline infers its shapes)."""
        self.cp_group: dist.ProcessGroup | None = None
        """Context parallelism's group: this rank holds 1/cp of each sequence's tokens."""
        self.feeds_aux_grad = False
        self._aux_sum: Tensor | None = None
        self._forwards = 0

    def forward(self, x: Tensor) -> Tensor:
        """x [B, S, dim] -> [B, S, dim]."""
        bsz, seqlen, dim = x.shape
        flat = x.reshape(-1, dim)
        weights, experts, scores = self.router(flat)
        # One row per (token, choice): its expert, and whether it fits the expert's capacity.
        choice_expert = experts.reshape(-1)
        keep = self._within_capacity(experts.view(bsz, seqlen, self.top_k))
        if self.load_balance == "aux_loss":
            self.aux_loss = self._aux_loss(scores.view(bsz, seqlen, -1), experts.view(bsz, seqlen, -1))
        # Training forwards only: not evaluation, a pipeline's shape inference (both without grad) or
        # a forward activation checkpointing recomputes in backward.
        if self.counting and torch.is_grad_enabled() and not _in_backward():
            self._count(choice_expert, keep)
        # Dropped copies sort after every expert (id n_experts) and are cut off; stable, so within
        # an expert the copies stay in token order.
        sort_key = choice_expert if keep is None else choice_expert.masked_fill(~keep, self.n_experts)
        order = sort_key.argsort(stable=True)
        counts = torch.bincount(sort_key, minlength=self.n_experts + 1)[: self.n_experts]
        order = order[: int(counts.sum())]
        token = order // self.top_k
        routed = self.experts(flat[token], counts)
        routed = (routed.float() * weights.reshape(-1)[order, None]).to(x.dtype)
        out = torch.zeros_like(flat).index_add_(0, token, routed)
        if self.shared is not None:
            out = out + self.shared(flat)
        out = out.view(bsz, seqlen, dim)
        if self.aux_loss is not None and self.feeds_aux_grad and torch.is_grad_enabled():
            out = _AuxLossGrad.apply(out, self.aux_loss, self.aux_weight)
        return out

    def capacity(self, seqlen: int) -> int:
        """Token copies one expert keeps per sequence (0: no limit)."""
        if self.capacity_factor <= 0:
            return 0
        return math.ceil(self.capacity_factor * seqlen * self.top_k / self.n_experts)

    def _within_capacity(self, experts: Tensor) -> Tensor | None:
        """Flat [B*S*k] mask of the copies an expert keeps: per sequence, its first ``capacity`` in token
        order (None when dropless)."""
        cap = self.capacity(experts.shape[1])
        if cap == 0:
            return None
        bsz = experts.shape[0]
        # Group the copies by (sequence, expert), token order kept within a group (a stable sort of
        # flat indices that grow with the token); a copy's position is its rank in its group.
        sequence = torch.arange(bsz, device=experts.device).repeat_interleave(experts[0].numel())
        group = sequence * self.n_experts + experts.reshape(-1)
        order = group.argsort(stable=True)
        sizes = torch.bincount(group, minlength=bsz * self.n_experts)
        starts = sizes.cumsum(0) - sizes
        position = torch.empty_like(group)
        position[order] = torch.arange(group.numel(), device=group.device) - starts[group[order]]
        return position < cap

    @torch.no_grad()
    def _count(self, choice_expert: Tensor, keep: Tensor | None) -> None:
        counts = torch.bincount(choice_expert, minlength=self.n_experts).float()
        dropped = choice_expert.new_zeros((), dtype=torch.float32)
        if keep is not None:
            dropped += (~keep).sum()
        aux = self.aux_loss.detach().float().clone() if self.aux_loss is not None else counts.new_zeros(())
        if self.tokens_per_expert is None or self.tokens_dropped is None or self._aux_sum is None:
            self.tokens_per_expert, self.tokens_dropped, self._aux_sum = counts, dropped, aux
        else:
            self.tokens_per_expert += counts
            self.tokens_dropped += dropped
            self._aux_sum += aux
        self._forwards += 1

    def take_load(self) -> ExpertLoad | None:
        """What the forwards since the last call saw, or None if none ran."""
        if self.tokens_per_expert is None or self.tokens_dropped is None or self._aux_sum is None:
            return None
        load = ExpertLoad(self.tokens_per_expert, self.tokens_dropped, self._aux_sum, self._forwards)
        self.tokens_per_expert = self.tokens_dropped = self._aux_sum = None
        self._forwards = 0
        return load

    def _aux_loss(self, scores: Tensor, experts: Tensor) -> Tensor:
        """Switch/GShard balance loss per sequence, averaged over sequences: 1 when perfectly balanced.

        ``f_e``: the fraction of the sequence's token copies that chose expert e (no gradient);
        ``P_e``: the mean over its tokens of e's score (normalised to sum to 1 for sigmoid scores).
        """
        bsz, seqlen, n_experts = scores.shape
        probs = scores / scores.sum(dim=-1, keepdim=True) if self.router.score == "sigmoid" else scores
        cp = 1 if self.cp_group is None else dist.get_world_size(self.cp_group)
        with torch.no_grad():
            chosen = torch.zeros(bsz, n_experts, device=scores.device)
            chosen.scatter_add_(1, experts.reshape(bsz, -1), torch.ones(bsz, seqlen * self.top_k, device=scores.device))
            if self.cp_group is not None:
                # The whole sequence's counts, from its chunks on the context-parallel ranks.
                dist.all_reduce(chosen, group=self.cp_group)
            fraction = chosen / (cp * seqlen * self.top_k)
        # Under cp this rank's part of each sequence's P_e (its tokens' sum over the whole length),
        # times cp: the loss is averaged over the cp ranks, so the parts add up to the whole.
        partial = probs.sum(dim=1) / (cp * seqlen)
        return cp * n_experts * (fraction * partial).sum(dim=-1).mean()


def moe_layers(modules: list[nn.Module]) -> list[MoE]:
    """The MoE layers of a model's parts (a whole model, or this rank's pipeline stages)."""
    return [m for part in modules for m in part.modules() if isinstance(m, MoE)]


def aux_loss_term(layers: list[MoE]) -> Tensor | None:
    """``aux_loss_coef`` times the mean over the model's MoE layers of this forward's aux losses, to add to
    the loss (None without aux-loss balancing). ``layers`` are all of them: a pipeline stage's layers
    feed their own gradient instead (``MoE.feeds_aux_grad``)."""
    terms = [m.aux_weight * m.aux_loss for m in layers if m.aux_loss is not None and m.aux_weight > 0]
    return torch.stack(terms).sum() if terms else None
