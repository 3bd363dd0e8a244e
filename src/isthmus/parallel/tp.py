"""Megatron-style 1-D tensor parallelism (and sequence parallelism) as DTensor plans.

Column-parallel q/k/v and w1/w3, row-parallel wo and w2: one all-reduce (or, with sequence
parallelism, one reduce-scatter + all-gather pair) per attention and per MLP. The embedding is
vocab-parallel (row-wise over the vocabulary), the output head column-parallel over the vocabulary
with its logits left sharded for loss-parallel cross-entropy, so the full [B, S, V] logits never
exist on one rank.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from isthmus.models.llama import Transformer


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard ``model`` (a Transformer or a pipeline stage of one) over ``tp_mesh`` in place."""
    # Between blocks activations are sequence-sharded with SP, replicated without.
    between = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, ParallelStyle] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if getattr(model, "norm", None) is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        top["output"] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)
    if top:
        parallelize_module(model, tp_mesh, top)
    if sequence_parallel:
        model.hidden_seq_shards = tp_mesh.size()

    for block in model.layers.values():
        plan: dict[str, ParallelStyle] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=between),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=between),
        }
        if getattr(block.get_submodule("feed_forward"), "w3", None) is not None:
            plan["feed_forward.w3"] = ColwiseParallel()
        if sequence_parallel:
            plan.update(
                {
                    "attention_norm": SequenceParallel(),
                    "ffn_norm": SequenceParallel(),
                    # (x, cos, sin): gather the sequence for attention; rotary tables are plain tensors.
                    "attention": PrepareModuleInput(
                        input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                    ),
                    "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                }
            )
        parallelize_module(block, tp_mesh, plan)
