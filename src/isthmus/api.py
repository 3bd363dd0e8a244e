"""The Python API for your own training loop: one call turns a model into this rank's parallel model.

    pm = isthmus.parallelize(build_model(args, "meta"), layout)   # a LayoutSpec, or ParallelDims
    for inputs, targets in batches:                       # this rank's data-parallel slice
        inputs, targets = shard_batch(pm, inputs, targets, mesh)
        loss = step(pm, inputs, targets)                  # forward + backward, any layout
        clip_grad_norm(pm, 1.0, mesh)
        optimizer.step(); optimizer.zero_grad()

The loop never branches on the layout: the helpers below hide what differs between a plain module,
tensor parallelism (vocab-parallel cross-entropy), context parallelism (sequence chunks) and a
pipeline schedule. They call the same functions as `isthmus.train.trainer`.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from isthmus.config import JobConfig, set_value
from isthmus.errors import ConfigError
from isthmus.layout.dims import Meshes, ParallelDims, check_layout
from isthmus.layout.spec import LayoutSpec
from isthmus.models.llama import Transformer, build_model
from isthmus.parallel.parallelize import ParallelModel, apply_layout
from isthmus.profile.device import resolve_device
from isthmus.train import step as _step
from isthmus.train.grad import clip_grad_norm as _clip
from isthmus.train.step import LossFn

__all__ = ["LayoutSpec", "ParallelModel", "clip_grad_norm", "loss_context", "parallelize", "shard_batch", "step"]


def parallelize(
    model: Transformer,
    layout: LayoutSpec | ParallelDims,
    *,
    seed: int = 0,
    seq_len: int | None = None,
    loss_fn: LossFn | None = None,
    device: torch.device | str | None = None,
    mesh: Meshes | None = None,
    dtype: str = "fp32",
    compile: bool = False,
) -> ParallelModel:
    """This rank's part of ``model`` laid out as ``layout`` says, with its local shards initialised.

    ``model`` is best built on the meta device (``build_model(args, "meta")``): only this rank's
    shards are ever allocated. A model with real weights is accepted, but its weights are not
    used: a meta copy is built from ``model.args``, and every layout (one process included) starts
    from the weights that ``seed`` gives, exactly those of the single-process model of that seed.

    - ``layout``: a :class:`~isthmus.layout.LayoutSpec` (its ``[parallel]`` keys; what
      ``isthmus plan --json`` prints under ``layout``), or just the degrees as :class:`ParallelDims`
      (the other keys take the config's defaults). Cross-datacenter sync (``sync``) is run by
      ``isthmus train``, not here, and gradient accumulation (``grad_accum``) by your loop.
    - ``layout.world > 1`` needs the default process group (run under torchrun and call
      ``torch.distributed.init_process_group()`` first). ``mesh`` defaults to ``dims.build_mesh``;
      build it yourself and pass it when the loop needs it too (the dp rank, cp, pp).
    - ``seq_len`` is required for pp > 1 (stages are balanced by their cost at this length); when
      given, the sequence rules of context/sequence parallelism are checked up front.
    - ``loss_fn(logits, targets)``, the mean over its batch, is what the pipeline schedule computes
      on its last stage (pp > 1 only; default: next-token cross-entropy).
    - ``device``: default CUDA device ``LOCAL_RANK`` when there is a GPU, else the CPU.
    - ``dtype`` (``train.dtype``): "fp32", or "bf16": FSDP layouts then compute through FSDP2's
      mixed precision (bf16 weights gathered over fp32 masters, fp32 reductions), the others under
      ``torch.autocast``, which :func:`step` applies (``result.autocast``).
    - ``compile`` (``train.compile``): compile each transformer block with ``torch.compile``; the
      loss is yours to compile.

    With pp > 1 the result's ``schedule`` runs the stages in ``modules``; run it with :func:`step`.
    """
    if not isinstance(model, Transformer):
        raise ConfigError(
            "model", type(model).__name__, "isthmus.parallelize takes an isthmus Transformer (isthmus.build_model)"
        )
    if dtype not in ("fp32", "bf16"):
        raise ConfigError("dtype", dtype, "must be fp32 or bf16")
    spec = layout if isinstance(layout, LayoutSpec) else _spec_of(layout)
    if spec.sync != "none":
        raise ConfigError(
            "sync", spec.sync, "is run by isthmus train (its strategy owns the loop's synchronisation); use none here"
        )
    if spec.world > 1 and not dist.is_initialized():
        raise ConfigError(
            "layout.world",
            spec.world,
            "needs the default process group: run under torchrun and call torch.distributed.init_process_group() first",
        )
    if dist.is_initialized() and dist.get_world_size() != spec.world:
        raise ConfigError("layout.world", spec.world, f"must equal the process group's size, {dist.get_world_size()}")
    args = model.args
    if spec.pp > 1 and seq_len is None:
        raise ConfigError(
            "seq_len", None, "is needed for pp > 1: the pipeline balances its stages by their cost at this length"
        )
    # check_layout holds every layout rule, on the config the spec converts to. Its batch is a
    # placeholder that satisfies the batch rule: a custom loop's batch size is not known here
    # (pipeline_step checks it).
    checked_len = seq_len if seq_len is not None else 2 * spec.cp * spec.tp
    cfg = JobConfig()
    for key, value in {**spec.config_overrides(batch=False), "train.seq_len": checked_len}.items():
        set_value(cfg, key, value, from_cli=False)
    cfg.train.batch_size = spec.dp * spec.microbatches
    cfg.train.grad_accum = 1
    dims = check_layout(
        cfg,
        args.n_heads,
        args.n_kv_heads,
        args.n_layers,
        n_experts=args.n_experts,
        capacity_factor=args.capacity_factor,
    )
    if any(t.device.type != "meta" for t in model.parameters()):
        model = build_model(args, device="meta")
    resolved = _resolve_device(device)
    if mesh is None and dims.world_size > 1:
        mesh = dims.build_mesh(resolved.type)
    return apply_layout(
        model,
        dims,
        cfg.parallel,
        mesh,
        device=resolved,
        seed=seed,
        seq_len=checked_len,
        loss_fn=loss_fn or _step.cross_entropy,
        dtype=dtype,
        compile=compile,
    )


def shard_batch(
    pm: ParallelModel, inputs: torch.Tensor, targets: torch.Tensor, mesh: Meshes | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's sequence chunks of a [B, S] batch under context parallelism; the batch itself otherwise.

    Pass this rank's data-parallel slice (``mesh["dp"].get_local_rank()`` of ``dims.dp``); every
    rank of a tensor-, context- or pipeline-parallel group passes the same one.
    """
    cp_rank = 0
    if pm.dims.cp_enabled:
        if mesh is None:
            raise ConfigError(
                "mesh", None, "context parallelism needs the mesh that parallelize used (dims.build_mesh)"
            )
        cp_rank = mesh["cp"].get_local_rank()
    return _step.shard_batch(pm, inputs, targets, cp_rank)


loss_context = _step.loss_context


def step(
    pm: ParallelModel, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn | None = None
) -> torch.Tensor | None:
    """Forward and backward of one local batch (under bf16 autocast when ``pm.autocast``); gradients are left in ``.grad``.

    Returns the detached loss (a plain tensor) of this rank's batch (the mean over its micro-batches under pp), or
    None on a pipeline rank without the last stage. ``loss_fn`` defaults to next-token
    cross-entropy; under pp the schedule computes the loss with the one given to
    :func:`parallelize`, so pass that one or None.
    """
    if pm.schedule is not None and loss_fn is not None and loss_fn is not pm.schedule._loss_fn:
        name = getattr(loss_fn, "__name__", loss_fn)
        raise ConfigError("loss_fn", name, "under pp the schedule computes the loss: give it to parallelize, None here")
    with pm.compute_precision(inputs.device.type):
        loss = _step.forward_backward(pm, inputs, targets, loss_fn=loss_fn or _step.cross_entropy)
    return None if loss is None else _plain(loss)


def clip_grad_norm(pm: ParallelModel, max_norm: float, mesh: Meshes | None) -> float:
    """Clip to ``max_norm`` by the norm over the whole model (every shard and stage); returns that norm.

    torch's ``clip_grad_norm_`` sees only this rank's stages and refuses gradients on several meshes.
    """

    pp_group = None
    if pm.dims.pp_enabled:
        if mesh is None:
            raise ConfigError(
                "mesh", None, "pipeline parallelism needs the mesh that parallelize used (dims.build_mesh)"
            )
        pp_group = mesh["pp"].get_group()
    return _clip(pm.parameters(), max_norm, pp_group)


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A loss of one's own computed under torch's loss-parallel is a replicated DTensor (so ``full_tensor``
    communicates nothing); hand back a plain one."""

    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _spec_of(dims: ParallelDims) -> LayoutSpec:
    """The layout of ``dims``'s degrees, every other key at the config's default."""
    cfg = JobConfig()
    cfg.parallel.nproc = dims.world_size
    for f in dataclasses.fields(dims):
        key = LayoutSpec.config_key(f.name)  # the degrees and datacenters: world_size is nproc's
        if key is not None:
            set_value(cfg, key, getattr(dims, f.name), from_cli=False)
    return LayoutSpec.from_config(cfg)


def _resolve_device(device: torch.device | str | None) -> torch.device:

    if device is None or (isinstance(device, str) and device in ("auto", "cpu", "cuda")):
        return resolve_device(device or "auto", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(device)
