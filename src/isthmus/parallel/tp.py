"""Megatron-style 1-D tensor parallelism (and sequence parallelism) on DTensor parameters.

Column-parallel q/k/v and w1/w3, row-parallel wo and w2: one all-reduce (or, with sequence
parallelism, one all-gather before and one reduce-scatter after) per attention and per MLP. The
embedding is vocab-parallel (row-wise over the vocabulary), the output head column-parallel over the
vocabulary with its logits left sharded for the vocab-parallel cross-entropy, so the full [B, S, V]
logits never exist on one rank. With sequence parallelism (Korthikanti et al. 2022) the hidden states
between the tensor-parallel regions are split along the sequence, so the norms and the residual adds
run on 1 / tp of the tokens on each rank: the embedding reduce-scatters instead of all-reducing, the
attention and the MLP all-gather their input, and the head all-gathers the final norm's output.

The weights are DTensors (so optimizer state, FSDP on top, checkpoints and resharding see them as
everywhere else; the norms' scales, the same on every rank, stay plain tensors) but the compute is on
their local shards, in the blocks, the embedding and the head alike, with Megatron's conjugate
collectives written out (:class:`_CopyToTP` / :class:`_ReduceFromTP`, :class:`_GatherFromSP` /
:class:`_ScatterToSP`), through shared memory where the group's ranks share a host
(`isthmus.parallel.shm_collectives`), else the backend's. Only the head's logits become a DTensor
again, for the loss (:func:`vocab_parallel_cross_entropy`, whatever the layout). Why not torch's
``parallelize_module`` plans: they wrap every Linear's and norm's input and output in DTensors, so
each matmul, its backward and each redistribution pays DTensor's Python dispatch (a large share of
a CPU step; with sequence parallelism its all-gathers and reduce-scatters also went through gloo:
profiles in dev/LOG.md), and each of q, k and v all-reduces its own input
gradient in the backward where one collective of their sum does (3 -> 1 per attention, 2 -> 1 per
SwiGLU MLP).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor

from isthmus.models.llama import RMSNorm, Transformer, rms_norm
from isthmus.models.moe import MoE
from isthmus.parallel.shm_collectives import BackendCollectives, build_collectives

SEQ_DIM = 1
"""The sequence dimension of the hidden states [B, S, D], which sequence parallelism splits."""


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool, timeout_s: float) -> None:
    """Shard ``model`` (a Transformer or a pipeline stage of one) over ``tp_mesh`` in place; its
    collectives give up after ``timeout_s`` seconds without every rank (parallel.timeout_s)."""
    comm = build_collectives(tp_mesh.get_group(), timeout_s)
    sp = sequence_parallel
    if model.tok_embeddings is not None:
        model.tok_embeddings = VocabShardedEmbedding(model.tok_embeddings, tp_mesh, comm, sp)  # type: ignore[assignment]
    if model.output is not None:
        model.output = VocabShardedHead(model.output, tp_mesh, comm, sp)  # type: ignore[assignment]
    model.tie_weights()  # a tied head is the embedding's (same rows, same Shard(0))
    if sp:
        if model.norm is not None:
            model.norm = SequenceShardedNorm(model.norm, comm)
        model.hidden_seq_shards = tp_mesh.size()
    for block in model.layers.values():
        shard_block_locally(block, tp_mesh, comm, sp)


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward; the backward sums the input's gradient over the TP group
    (each rank's column shard contributed part of it)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, comm: BackendCollectives) -> Tensor:
        ctx.comm = comm  # type: ignore[attr-defined]
        return x

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        ctx.comm.all_reduce(grad)  # type: ignore[attr-defined]
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: the forward sums the row-parallel partial outputs over the TP group; identity
    backward (every rank needs the whole output gradient, and has it)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, comm: BackendCollectives) -> Tensor:
        comm.all_reduce(x)  # x is the fresh output of this rank's matmul: ours to overwrite
        return x

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GatherFromSP(torch.autograd.Function):
    """Sequence parallelism's entry to a tensor-parallel region: the forward all-gathers the sequence
    shards (every rank's column shard needs every token); the backward reduce-scatters the input's
    gradient (each rank's column shard contributed part of every token's)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, comm: BackendCollectives) -> Tensor:
        ctx.comm = comm  # type: ignore[attr-defined]
        return comm.all_gather(x, SEQ_DIM)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return ctx.comm.reduce_scatter(grad, SEQ_DIM), None  # type: ignore[attr-defined]


class _ScatterToSP(torch.autograd.Function):
    """Sequence parallelism's exit from a tensor-parallel region: the forward sums the row-parallel
    partial outputs and keeps this rank's sequence shard (a reduce-scatter); the backward all-gathers
    the gradient of the shards."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, comm: BackendCollectives) -> Tensor:
        ctx.comm = comm  # type: ignore[attr-defined]
        return comm.reduce_scatter(x, SEQ_DIM)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return ctx.comm.all_gather(grad, SEQ_DIM), None  # type: ignore[attr-defined]


def _entry(sequence_parallel: bool) -> type[torch.autograd.Function]:
    """What a tensor-parallel region's input passes through: the sequence all-gathered under sequence
    parallelism, else the identity whose backward sums the input's gradient."""
    return _GatherFromSP if sequence_parallel else _CopyToTP


def _exit(sequence_parallel: bool) -> type[torch.autograd.Function]:
    """What a tensor-parallel region's partial output passes through: summed and scattered over the
    sequence under sequence parallelism, else summed."""
    return _ScatterToSP if sequence_parallel else _ReduceFromTP


class ShardedLinear(nn.Module):
    """A bias-free Linear whose ``weight`` is a DTensor sharded over the TP mesh, computed on its local
    shard: column-parallel (Shard(0): this rank's output features) or row-parallel (Shard(1): this
    rank's input features, outputs summed over the group, or with ``sequence_parallel`` summed and
    scattered over the sequence). Same parameter name as nn.Linear's."""

    def __init__(
        self,
        linear: nn.Linear,
        mesh: DeviceMesh,
        placement: Placement,
        comm: BackendCollectives,
        sequence_parallel: bool = False,
        reduce: bool = True,
    ) -> None:
        super().__init__()
        assert linear.bias is None, "the model's Linears have no bias"
        self.weight: nn.Parameter = nn.Parameter(
            distribute_tensor(linear.weight, mesh, [placement], src_data_rank=None)
        )
        # A row-parallel output is summed over the group here, unless ``reduce`` is False: a MoE's
        # shared expert, whose partial output joins the routed experts' before one sum for both.
        self.row: bool = placement == Shard(1) and reduce
        self.comm: BackendCollectives = comm
        self.sequence_parallel: bool = sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        out = F.linear(x, weight)
        return _exit(self.sequence_parallel).apply(out, self.comm) if self.row else out


def first_of_shard(vocab: int, mesh: DeviceMesh) -> int:
    """The first vocabulary row of this rank's Shard(0) (or column of its Shard(-1)): DTensor splits
    as torch.chunk does, ceil(vocab / size) per rank, the last ones fewer or none."""
    return min(mesh.get_local_rank() * -(-vocab // mesh.size()), vocab)


class VocabShardedEmbedding(nn.Module):
    """The token embedding with its rows (the vocabulary) sharded over the TP mesh, Megatron's
    vocab-parallel embedding: each rank looks up the ids in its range, zeros elsewhere, and the sum
    over the group is every token's row (one non-zero term: exact); with ``sequence_parallel`` each
    rank keeps the sum for its sequence shard (a reduce-scatter). What torch's RowwiseParallel does on
    an Embedding, on the local shard and through this layout's collectives."""

    def __init__(
        self, embedding: nn.Embedding, mesh: DeviceMesh, comm: BackendCollectives, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        vocab = embedding.num_embeddings
        self.weight: nn.Parameter = nn.Parameter(
            distribute_tensor(embedding.weight, mesh, [Shard(0)], src_data_rank=None)
        )
        self.first: int = first_of_shard(vocab, mesh)
        self.comm: BackendCollectives = comm
        self.sequence_parallel: bool = sequence_parallel

    def forward(self, ids: Tensor) -> Tensor:
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        local = ids - self.first
        outside = (local < 0) | (local >= weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return _exit(self.sequence_parallel).apply(rows, self.comm)


class VocabShardedHead(ShardedLinear):
    """The output head, column-parallel over the vocabulary: its logits stay sharded (a DTensor,
    Shard(-1)) for :func:`vocab_parallel_cross_entropy`; its input's gradient is summed over the group.
    With ``sequence_parallel`` its input is this rank's sequence shard, all-gathered first."""

    def __init__(
        self, linear: nn.Linear, mesh: DeviceMesh, comm: BackendCollectives, sequence_parallel: bool = False
    ) -> None:
        super().__init__(linear, mesh, Shard(0), comm, sequence_parallel)
        self.mesh = mesh
        self.vocab: int = linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        local = super().forward(_entry(self.sequence_parallel).apply(x, self.comm))
        # The global shape given, not inferred: a vocabulary the group does not divide shards unevenly.
        shape = torch.Size((*local.shape[:-1], self.vocab))
        return DTensor.from_local(local, self.mesh, [Shard(-1)], run_check=False, shape=shape, stride=_strides(shape))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's vocab-parallel cross-entropy on this rank's logit columns [N, V / tp]: the row maxima
    and then the sums of exponentials and the target logits are reduced over the group (two
    all-reduces of N values), so no rank ever holds [N, V]; the backward is local (softmax minus
    the one-hot of the target, where the target is this rank's column)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, local: Tensor, targets: Tensor, first: int, group: dist.ProcessGroup
    ) -> Tensor:
        row_max = local.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = local - row_max.unsqueeze(-1)
        column = targets - first
        mine = (column >= 0) & (column < local.shape[-1])
        column = column.masked_fill(~mine, 0)
        exp = shifted.exp()
        sums = torch.stack((exp.sum(dim=-1), shifted.gather(-1, column.unsqueeze(-1)).squeeze(-1) * mine))
        dist.all_reduce(sums, group=group)
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), column, mine)
        return sums[0].log() - sums[1]

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        softmax, column, mine = ctx.saved_tensors  # type: ignore[attr-defined]
        softmax.scatter_add_(-1, column.unsqueeze(-1), -mine.to(softmax.dtype).unsqueeze(-1))
        return softmax.mul_(grad.unsqueeze(-1)), None, None, None


def vocab_parallel_cross_entropy(logits: DTensor, targets: Tensor) -> Tensor:
    """Mean next-token loss of logits sharded over the vocabulary on a 1-D mesh (the tensor-parallel
    head's), in fp32, as ``F.cross_entropy`` of the whole logits would give it.

    Written out rather than torch's ``loss_parallel``, which runs the same maths through DTensor's
    dispatch op by op, at about twice the time (benchmarks/tp_collectives.py; figures in
    dev/LOG.md)."""
    mesh = logits.device_mesh
    vocab = logits.shape[-1]
    first = first_of_shard(vocab, mesh)
    local = logits.to_local().float().flatten(0, -2)
    losses = _VocabParallelCrossEntropy.apply(local, targets.flatten(), first, mesh.get_group())
    return losses.mean()


def is_vocab_sharded(logits: Tensor) -> bool:
    """Logits as the tensor-parallel head leaves them: a DTensor on a 1-D mesh, sharded on its last dim."""
    return (
        isinstance(logits, DTensor)
        and logits.device_mesh.ndim == 1
        and logits.placements[0] in (Shard(-1), Shard(logits.ndim - 1))
    )


def _strides(shape: torch.Size) -> tuple[int, ...]:
    """A contiguous tensor's strides for ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class SequenceShardedNorm(RMSNorm):
    """An RMSNorm on this rank's sequence shard (sequence parallelism): the same scale on every rank,
    its gradient from this rank's tokens summed over the group in the backward (:class:`_CopyToTP`
    on the weight), as Megatron all-reduces its sequence-parallel norms' gradients."""

    def __init__(self, norm: RMSNorm, comm: BackendCollectives) -> None:
        nn.Module.__init__(self)  # not RMSNorm's: the scale is ``norm``'s own Parameter, not a new one
        self.eps = norm.eps
        self.weight = norm.weight
        self.comm = comm

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, _CopyToTP.apply(self.weight, self.comm), self.eps)


def _enter_tp_hook(comm: BackendCollectives, sequence_parallel: bool) -> Callable[[nn.Module, tuple], tuple]:
    enter = _entry(sequence_parallel)

    def hook(_: nn.Module, args: tuple) -> tuple:
        return (enter.apply(args[0], comm), *args[1:])

    return hook


def shard_block_locally(
    block: nn.Module, tp_mesh: DeviceMesh, comm: BackendCollectives, sequence_parallel: bool = False
) -> None:
    """Column-shard q/k/v and w1/w3, row-shard wo and w2 of one block, computed on local shards.

    The attention's and the MLP's input pass through one :class:`_CopyToTP` each (a forward
    pre-hook), so their input gradients are summed over the group once per module, not per Linear;
    with ``sequence_parallel``, through one :class:`_GatherFromSP` each, the row-parallel outputs
    through :class:`_ScatterToSP`, and the block's norms run on the sequence shard. ``comm`` is
    ``tp_mesh``'s group's collectives (`isthmus.parallel.shm_collectives`).
    """
    ffn = block.get_submodule("feed_forward")
    if isinstance(ffn, MoE):
        shard_moe_locally(ffn, tp_mesh, comm, sequence_parallel)
    for module_name, column, row in (("attention", ("wq", "wk", "wv"), "wo"), ("feed_forward", ("w1", "w3"), "w2")):
        if module_name == "feed_forward" and isinstance(ffn, MoE):
            continue
        module = block.get_submodule(module_name)
        for name in column:
            linear = getattr(module, name, None)
            if linear is not None:
                setattr(module, name, ShardedLinear(linear, tp_mesh, Shard(0), comm))
        setattr(module, row, ShardedLinear(getattr(module, row), tp_mesh, Shard(1), comm, sequence_parallel))
        module.register_forward_pre_hook(_enter_tp_hook(comm, sequence_parallel))
    if sequence_parallel:
        for name in ("attention_norm", "ffn_norm"):
            norm = block.get_submodule(name)
            assert isinstance(norm, RMSNorm), f"{name} is the block's RMSNorm"
            setattr(block, name, SequenceShardedNorm(norm, comm))
    attention = block.get_submodule("attention")
    for name in ("q_norm", "k_norm"):
        # Qwen3's per-head norms: each rank normalises its own heads with the one shared scale, so the
        # scale's gradient is summed over the group, as a sequence-sharded norm's is over tokens.
        qk_norm = getattr(attention, name, None)
        if isinstance(qk_norm, RMSNorm):
            setattr(attention, name, SequenceShardedNorm(qk_norm, comm))


def _exit_tp_hook(comm: BackendCollectives, sequence_parallel: bool) -> Callable[[nn.Module, tuple, Tensor], Tensor]:
    leave = _exit(sequence_parallel)

    def hook(_: nn.Module, args: tuple, out: Tensor) -> Tensor:
        return leave.apply(out, comm)

    return hook


def shard_moe_locally(moe: MoE, tp_mesh: DeviceMesh, comm: BackendCollectives, sequence_parallel: bool = False) -> None:
    """Tensor-parallel MoE layer: every expert split along its hidden dimension, as the dense MLP is.

    The layer's input enters the group once (all-gathered under sequence parallelism), so every
    rank routes every token alike with the whole router (a replicated weight). Each rank runs every
    routed and shared expert on its slice of their hidden units (w1, w3 Shard(1), w2 Shard(2) of
    the stacked [E, ...] weights; the shared expert column/row-parallel), weights its partial
    outputs by the scores and sums them per token; one sum over the group (a reduce-scatter under
    sequence parallelism) then completes routed and shared outputs together.

    Backward: every contribution is a per-rank part whose sum over the group is the whole, as in
    any tensor-parallel region: the router's weight gradient (from partial outputs) is summed over
    the group like a sequence-parallel norm's, and the auxiliary loss, whole on every rank, enters
    each rank's loss with 1 / tp of its weight so that the summed gradients count it once.
    """
    experts = moe.experts
    for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
        param = getattr(experts, name)
        sharded = distribute_tensor(param, tp_mesh, [Shard(dim)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded))
    if moe.shared is not None:
        shared = moe.shared
        shared.w1 = ShardedLinear(shared.w1, tp_mesh, Shard(0), comm)  # type: ignore[assignment]
        if shared.w3 is not None:
            shared.w3 = ShardedLinear(shared.w3, tp_mesh, Shard(0), comm)  # type: ignore[assignment]
        shared.w2 = ShardedLinear(shared.w2, tp_mesh, Shard(1), comm, reduce=False)  # type: ignore[assignment]
    moe.router.weight_grad_sum = lambda w: _CopyToTP.apply(w, comm)
    moe.aux_weight /= tp_mesh.size()
    moe.register_forward_pre_hook(_enter_tp_hook(comm, sequence_parallel))
    moe.register_forward_hook(_exit_tp_hook(comm, sequence_parallel))
