"""`apply_layout`: turn a model built on the meta device into this rank's parallel model.

Order, fixed (each step needs the one before it):
1. pipeline split (pp): this rank keeps only its stages' layers;
2. tensor + sequence parallel (tp): DTensor plans on each stage; then expert parallelism (ep):
   the MoE layers' experts sharded by expert over the ep mesh, tokens routed by all-to-all;
3. context parallel (cp): the attention kernel becomes ring or Ulysses attention;
4. activation checkpointing: wraps blocks, after TP so recomputation replays the sharded ops;
   then, under ``train.compile``, each block is compiled (`isthmus.parallel.compile`);
5. FSDP2 (dp_shard, HSDP, or replication next to tp/pp, ZeRO-1's included): wraps blocks, after
   AC so each block's gather/reshard brackets its recomputation too;
6. materialise only the local shards (`to_empty`) and initialise them to exactly the values of
   the single-process model of the same seed;
7. DDP / ZeRO-1 (dp_shard alone): wraps the materialised model (DDP broadcasts real tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from isthmus.config import ParallelConfig
from isthmus.layout import rules
from isthmus.layout.dims import Meshes, ParallelDims
from isthmus.models.llama import Transformer, init_weights
from isthmus.models.moe import MoE, moe_layers
from isthmus.parallel.ac import apply_ac
from isthmus.parallel.compile import compile_blocks
from isthmus.parallel.context import apply_cp, cp_positions
from isthmus.parallel.data_parallel import (
    DataParallelKind,
    apply_ddp,
    apply_fsdp,
    data_parallel_kind,
    expert_fsdp_mesh,
    fsdp_mesh,
    sharded_optimizer,
    zero1_mesh,
)
from isthmus.parallel.expert import apply_ep
from isthmus.parallel.pipeline import build_pipeline, local_stages
from isthmus.parallel.tp import apply_tp


@dataclass
class ParallelModel:
    """What `apply_layout` (and `isthmus.parallelize`) hands the training loop."""

    modules: list[nn.Module]
    """This rank's model parts: one module, or its pipeline stages in stage order."""
    dims: ParallelDims
    dp_kind: DataParallelKind
    schedule: Any = None
    """The pipeline schedule when pp > 1 (a `torch.distributed.pipelining` schedule)."""
    has_first_stage: bool = True
    has_last_stage: bool = True
    loss_parallel: bool = False
    """Logits are vocab-sharded DTensors: `train.step.cross_entropy` takes its vocab-parallel form, a loss of
    one's own needs `train.step.loss_context` (torch's loss_parallel)."""
    autocast: bool = False
    """Run forward and backward under ``torch.autocast`` (bf16): the weights are fp32 and nothing
    casts them (DDP, one process); False under FSDP's mixed precision or in fp32."""
    moe: list[MoE] = field(default_factory=list)
    """This rank's Mixture-of-Experts layers (their aux losses and expert loads)."""
    sharded_optimizer: bool = False
    """ZeRO-1 over FSDP2's replicated weights: the optimizer state is sharded over dp_shard x cp
    (`isthmus.train.zero1.ShardedOptimizer`)."""

    @property
    def model(self) -> nn.Module:
        """The single module of a non-pipelined run."""
        assert len(self.modules) == 1 and self.schedule is None
        return self.modules[0]

    def compute_precision(self, device_type: str) -> AbstractContextManager[Any]:
        """What forward and backward run under: bf16 autocast where ``autocast``, else nothing (fp32,
        or FSDP's mixed precision, which casts by itself)."""
        if self.autocast:
            return torch.autocast(device_type, dtype=torch.bfloat16)
        return nullcontext()

    def parameters(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for m in self.modules:
            for p in m.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())


def _uncounted_metadata_inference(schedule: Any) -> None:
    """Keep the forward torch's pipeline stages run once to infer their shapes (the first step's first
    micro-batch again, or empty tensors on later stages) out of the MoE layers' expert counts, which
    the bias method and the metrics read. torch 2.13 runs it in ``_forward_metadata_inference``."""
    for stage in local_stages(schedule):
        layers = moe_layers([stage.submod])
        infer = stage._forward_metadata_inference

        def uncounted(*args: Any, _infer: Any = infer, _layers: list[MoE] = layers, **kwargs: Any) -> Any:
            for layer in _layers:
                layer.counting = False
            try:
                return _infer(*args, **kwargs)
            finally:
                for layer in _layers:
                    layer.counting = True

        stage._forward_metadata_inference = uncounted  # type: ignore[method-assign]


def _inject_cp_positions(module: Transformer, cp_rank: int, cp_size: int) -> None:
    """Give the model the global positions of its load-balanced sequence chunks (for RoPE).

    A forward pre-hook rather than an argument: pipeline stages are called by torch's schedule
    with the activation alone, and this keeps the trainer and the stage calls layout-agnostic.
    """

    def hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:  # noqa: ANN001
        if kwargs.get("positions") is None:
            local = module.input_seq_len(args[0])
            kwargs["positions"] = cp_positions(local * cp_size, cp_rank, cp_size).to(args[0].device)
        return args, kwargs

    module.register_forward_pre_hook(hook, with_kwargs=True)


def _shard_stage(
    module: Transformer,
    mesh: Meshes | None,
    dims: ParallelDims,
    p: ParallelConfig,
    dp_kind: DataParallelKind,
    geo_sync: bool = False,
    dtype: str = "fp32",
    compile: bool = False,
    replicate_mesh: DeviceMesh | None = None,
) -> Transformer:
    """Steps 2-5 on one module (the whole model, or one pipeline stage); ``replicate_mesh``: FSDP2's
    mesh under ZeRO-1 (`zero1_mesh`), which replicates instead of sharding."""
    if dims.tp_enabled:
        assert mesh is not None
        apply_tp(module, mesh["tp"], p.sequence_parallel, p.timeout_s)
    if dims.ep_enabled:
        assert mesh is not None and mesh.experts is not None
        apply_ep(module, mesh.experts["ep", "etp"] if dims.tp_enabled else mesh.experts["ep"])
    if dims.cp_enabled:
        assert mesh is not None
        apply_cp(module, mesh["cp"].get_group(), p.cp_impl)
        for layer in moe_layers([module]):
            layer.cp_group = mesh["cp"].get_group()  # its aux loss counts whole sequences
        _inject_cp_positions(module, mesh["cp"].get_local_rank(), dims.cp)
    apply_ac(module, p.activation_checkpoint)
    if compile:
        compile_blocks(module)
    if dp_kind == "fsdp":
        assert mesh is not None
        expert_mesh = expert_fsdp_mesh(mesh, dims, geo_sync)
        dp_mesh = replicate_mesh or fsdp_mesh(mesh, dims, geo_sync)
        apply_fsdp(module, dp_mesh, p.zero_stage, dtype=dtype, expert_mesh=expert_mesh)
    return module


def apply_layout(
    model: Transformer,
    dims: ParallelDims,
    parallel: ParallelConfig,
    mesh: Meshes | None,
    *,
    device: torch.device,
    seed: int,
    seq_len: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    geo_sync: bool = False,
    dtype: str = "fp32",
    compile: bool = False,
) -> ParallelModel:
    """Apply ``parallel``'s layout to ``model`` (built on meta) on this rank; see the module doc for the order.

    The runtime's entry (the trainer and :func:`isthmus.parallelize` call it with a checked layout);
    users call :func:`isthmus.parallelize`, which checks the layout first.

    ``loss_fn(logits, targets)`` (mean over its micro-batch) is needed only for pp > 1, where the
    schedule computes the loss on the last stage. With ``geo_sync`` no data-parallel wrapper is
    applied: the cross-datacenter strategy (`isthmus.geo`) averages gradients or parameters itself.
    ``dtype`` ("fp32" or "bf16", ``train.dtype``): under bf16, FSDP layouts compute through FSDP2's
    mixed precision, the others under autocast (the result's ``autocast``). ``compile``
    (``train.compile``) compiles each block with torch.compile.
    """
    args = model.args
    dp_kind = data_parallel_kind(dims, parallel.zero_stage, geo_sync)
    loss_parallel = dims.tp_enabled
    autocast = rules.compute_precision(dtype, dp_kind) == "autocast"
    zero1 = sharded_optimizer(dims, parallel.zero_stage, geo_sync)
    replicate_mesh = zero1_mesh(mesh) if zero1 and mesh is not None else None

    def materialise(module: Transformer) -> Transformer:
        module = _shard_stage(module, mesh, dims, parallel, dp_kind, geo_sync, dtype, compile, replicate_mesh)
        module.to_empty(device=device)
        init_weights(module, seed, args)
        return module

    if dims.pp_enabled:
        assert mesh is not None and loss_fn is not None
        pp_mesh = mesh["pp"]
        schedule, stages, has_first, has_last = build_pipeline(
            model,
            args,
            pp_mesh.get_group(),
            pp_mesh.get_local_rank(),
            dims.pp,
            parallel.pp_schedule,
            parallel.microbatches,
            parallel.pp_virtual_stages,
            loss_fn,
            device,
            seq_len,
            prepare_stage=materialise,
            seed=seed,
        )
        moe = moe_layers(list(stages))
        for layer in moe:
            # The loss is computed on the last stage: each layer feeds its aux loss's gradient itself.
            layer.feeds_aux_grad = True
        if moe:
            _uncounted_metadata_inference(schedule)
        return ParallelModel(
            list(stages), dims, dp_kind, schedule, has_first, has_last, loss_parallel, autocast, moe, zero1
        )

    module: nn.Module = materialise(model)
    if dp_kind in ("ddp", "zero1"):
        assert mesh is not None
        module = apply_ddp(module, mesh["dp_cp"])
    return ParallelModel(
        [module],
        dims,
        dp_kind,
        loss_parallel=loss_parallel,
        autocast=autocast,
        moe=moe_layers([module]),
        sharded_optimizer=zero1,
    )
