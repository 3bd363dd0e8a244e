"""Megatron-style 1-D tensor parallelism (and sequence parallelism) on DTensor parameters.

Column-parallel q/k/v and w1/w3, row-parallel wo and w2: one all-reduce (or, with sequence
parallelism, one reduce-scatter + all-gather pair) per attention and per MLP. The embedding is
vocab-parallel (row-wise over the vocabulary), the output head column-parallel over the vocabulary
with its logits left sharded for the vocab-parallel cross-entropy, so the full [B, S, V] logits
never exist on one rank.

Without sequence parallelism the weights are DTensors (so optimizer state, FSDP on top,
checkpoints and resharding see them as everywhere else) but the compute is on their local shards,
in the blocks, the embedding and the head alike, with Megatron's two conjugate collectives written
out (:class:`_CopyToTP`, :class:`_ReduceFromTP`) and one all-reduce for all of them: through shared
memory where the group's ranks share a host (`isthmus.parallel.host_reduce`), else the backend's.
Only the head's logits become a DTensor again, for the loss (:func:`vocab_parallel_cross_entropy`,
whatever the layout). Why not torch's ``parallelize_module`` plans there: they wrap every Linear's
input and output in DTensors, so each matmul, its backward and each redistribution pays DTensor's
Python dispatch (profiled on the `small` flavor at tp 2 on CPU: ~15% of the step in
``PythonSubclass``/``_FromTorchTensor``/``Redistribute``), and each of q, k and v all-reduces its
own input gradient in the backward where one all-reduce of their sum does (3 -> 1 per attention,
2 -> 1 per SwiGLU MLP). Sequence parallelism keeps torch's plans (its norms and sequence
redistributions are what DTensor does well).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from isthmus.models.llama import Transformer
from isthmus.parallel.host_reduce import AllReduce, build_all_reduce


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool, timeout_s: float) -> None:
    """Shard ``model`` (a Transformer or a pipeline stage of one) over ``tp_mesh`` in place; the blocks'
    all-reduces give up after ``timeout_s`` seconds without every rank (parallel.timeout_s)."""
    if sequence_parallel:
        # torch's plans, activations sequence-sharded between the blocks.
        top: dict[str, ParallelStyle] = {}
        if getattr(model, "tok_embeddings", None) is not None:
            top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        if getattr(model, "norm", None) is not None:
            top["norm"] = SequenceParallel()
        if getattr(model, "output", None) is not None:
            top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
        if top:
            parallelize_module(model, tp_mesh, top)
        model.hidden_seq_shards = tp_mesh.size()
        all_reduce = None
    else:
        # One all-reduce for every collective of the embedding, the blocks and the head (shared memory
        # where the group's ranks share a host).
        all_reduce = build_all_reduce(tp_mesh.get_group(), timeout_s)
        if model.tok_embeddings is not None:
            model.tok_embeddings = VocabShardedEmbedding(model.tok_embeddings, tp_mesh, all_reduce)  # type: ignore[assignment]
        if model.output is not None:
            model.output = VocabShardedHead(model.output, tp_mesh, all_reduce)  # type: ignore[assignment]
        model.tie_weights()  # a tied head is the embedding's (same rows, same Shard(0))

    for block in model.layers.values():
        if all_reduce is not None:
            shard_block_locally(block, tp_mesh, all_reduce)
            continue
        plan: dict[str, ParallelStyle] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            # (x, cos, sin): gather the sequence for attention; rotary tables are plain tensors.
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        }
        if getattr(block.get_submodule("feed_forward"), "w3", None) is not None:
            plan["feed_forward.w3"] = ColwiseParallel()
        parallelize_module(block, tp_mesh, plan)


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward; the backward sums the input's gradient over the TP group
    (each rank's column shard contributed part of it)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, all_reduce: AllReduce) -> Tensor:
        ctx.all_reduce = all_reduce  # type: ignore[attr-defined]
        return x

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        ctx.all_reduce(grad)  # type: ignore[attr-defined]
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: the forward sums the row-parallel partial outputs over the TP group; identity
    backward (every rank needs the whole output gradient, and has it)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, all_reduce: AllReduce) -> Tensor:
        all_reduce(x)  # x is the fresh output of this rank's matmul: ours to overwrite
        return x

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class ShardedLinear(nn.Module):
    """A bias-free Linear whose ``weight`` is a DTensor sharded over the TP mesh, computed on its local
    shard: column-parallel (Shard(0): this rank's output features) or row-parallel (Shard(1): this
    rank's input features, outputs summed over the group). Same parameter name as nn.Linear's."""

    def __init__(self, linear: nn.Linear, mesh: DeviceMesh, placement: Placement, all_reduce: AllReduce) -> None:
        super().__init__()
        assert linear.bias is None, "the model's Linears have no bias"
        self.weight: nn.Parameter = nn.Parameter(
            distribute_tensor(linear.weight, mesh, [placement], src_data_rank=None)
        )
        self.row: bool = placement == Shard(1)
        self.all_reduce: AllReduce = all_reduce

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        out = F.linear(x, weight)
        return _ReduceFromTP.apply(out, self.all_reduce) if self.row else out


def first_of_shard(vocab: int, mesh: DeviceMesh) -> int:
    """The first vocabulary row of this rank's Shard(0) (or column of its Shard(-1)): DTensor splits
    as torch.chunk does, ceil(vocab / size) per rank, the last ones fewer or none."""
    return min(mesh.get_local_rank() * -(-vocab // mesh.size()), vocab)


class VocabShardedEmbedding(nn.Module):
    """The token embedding with its rows (the vocabulary) sharded over the TP mesh, Megatron's
    vocab-parallel embedding: each rank looks up the ids in its range, zeros elsewhere, and the sum
    over the group is every token's row (one non-zero term: exact). What torch's RowwiseParallel
    does on an Embedding, on the local shard and through this layout's all-reduce."""

    def __init__(self, embedding: nn.Embedding, mesh: DeviceMesh, all_reduce: AllReduce) -> None:
        super().__init__()
        vocab = embedding.num_embeddings
        self.weight: nn.Parameter = nn.Parameter(
            distribute_tensor(embedding.weight, mesh, [Shard(0)], src_data_rank=None)
        )
        self.first: int = first_of_shard(vocab, mesh)
        self.all_reduce: AllReduce = all_reduce

    def forward(self, ids: Tensor) -> Tensor:
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        local = ids - self.first
        outside = (local < 0) | (local >= weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return _ReduceFromTP.apply(rows, self.all_reduce)


class VocabShardedHead(ShardedLinear):
    """The output head, column-parallel over the vocabulary: its logits stay sharded (a DTensor,
    Shard(-1)) for :func:`vocab_parallel_cross_entropy`; its input's gradient is summed over the group."""

    def __init__(self, linear: nn.Linear, mesh: DeviceMesh, all_reduce: AllReduce) -> None:
        super().__init__(linear, mesh, Shard(0), all_reduce)
        self.mesh = mesh
        self.vocab: int = linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        local = super().forward(_CopyToTP.apply(x, self.all_reduce))
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
    dispatch op by op: forward and backward of [8, 256, 2048] logits on 2 CPU ranks, 21.3 ms
    median through ``loss_parallel``, 9.5 ms here, 6.8 ms for a plain cross-entropy of one rank's
    half alone (benchmarks/tp_collectives.py)."""
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


def _copy_to_tp_hook(all_reduce: AllReduce) -> Callable[[nn.Module, tuple], tuple]:
    def hook(_: nn.Module, args: tuple) -> tuple:
        return (_CopyToTP.apply(args[0], all_reduce), *args[1:])

    return hook


def shard_block_locally(block: nn.Module, tp_mesh: DeviceMesh, all_reduce: AllReduce) -> None:
    """Column-shard q/k/v and w1/w3, row-shard wo and w2 of one block, computed on local shards.

    The attention's and the MLP's input pass through one :class:`_CopyToTP` each (a forward
    pre-hook), so their input gradients are summed over the group once per module, not per Linear.
    ``all_reduce`` sums over ``tp_mesh``'s group (`isthmus.parallel.host_reduce`).
    """
    for module_name, column, row in (("attention", ("wq", "wk", "wv"), "wo"), ("feed_forward", ("w1", "w3"), "w2")):
        module = block.get_submodule(module_name)
        for name in column:
            linear = getattr(module, name, None)
            if linear is not None:
                setattr(module, name, ShardedLinear(linear, tp_mesh, Shard(0), all_reduce))
        setattr(module, row, ShardedLinear(getattr(module, row), tp_mesh, Shard(1), all_reduce))
        module.register_forward_pre_hook(_copy_to_tp_hook(all_reduce))
