"""Pipeline parallelism: split the Llama into stages and drive them with torch's schedules.

The split is manual (no tracing): every stage is a copy of the meta model with the
blocks of other stages deleted, so parameter names stay canonical ("layers.5.wq")
and ``init_weights`` gives each stage exactly the values of the full model.

Loss scaling. torch's schedules backward each micro-batch's loss on its own, so the
gradients are *summed* over micro-batches; with ``scale_grads=True`` (torch 2.13's
default, kept here) the stage divides the accumulated gradients by the number of
micro-batches after the last backward (``_PipelineStageBase.scale_grads``, after
FSDP's reduce-scatter). A ``loss_fn`` that returns the mean over its micro-batch
therefore yields exactly the gradient of the mean loss over the local batch, as long
as micro-batches have equal size (checked in :func:`pipeline_step`). Dividing the
loss by the micro-batch count as well would scale twice.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from isthmus.errors import ConfigError
from isthmus.layout import rules
from isthmus.layout.choices import PP_SCHEDULES
from isthmus.models.args import ModelArgs
from isthmus.models.flops import attention_flops_per_token, layer_matmul_params
from isthmus.models.llama import Transformer, init_weights

if TYPE_CHECKING:
    # torch.distributed.pipelining imports torch._dynamo (half a second of every process's start):
    # only a pipelined run imports it, in `build_pipeline`.
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineSchedule

LossFn = Callable[[Tensor, Tensor], Tensor]
PrepareStage = Callable[[Transformer], Transformer]
SCHEDULES = PP_SCHEDULES
# Eval hand-off header: [dtype index, ndim, sizes...] as int64.
HEADER_LEN = 8
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def stage_costs(args: ModelArgs, seq_len: int) -> tuple[int, int, int]:
    """Forward FLOPs per token of (one block, the embedding, the head; norm and loss are elementwise).

    The embedding is a gather: zero FLOPs, although its table costs memory on the
    first stage. The head is a dim x vocab matmul, for small models worth several
    blocks, so ignoring it would overload the last stage.
    """
    block = 2 * layer_matmul_params(args, active=True) + attention_flops_per_token(args, seq_len) // args.n_layers
    return block, 0, 2 * args.dim * args.vocab_size


def partition_layers(args: ModelArgs, n_stages: int, seq_len: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) block ranges per stage minimising the costliest stage.

    Exact dynamic programme over split points (O(stages * layers^2)); ties go to the
    first split found, so the result is deterministic.
    """
    n = args.n_layers
    if n_stages < 1 or n_stages > n:
        rule = f"pipeline stages (pp * virtual stages) must be in 1..n_layers = {n}"
        raise ConfigError("parallel.pp", n_stages, rule)
    block, embed, head = stage_costs(args, seq_len)

    def cost(start: int, end: int) -> int:
        return (end - start) * block + (embed if start == 0 else 0) + (head if end == n else 0)

    # best[s][i]: (max stage cost, split points) for layers [0, i) in s stages.
    best: list[dict[int, tuple[int, list[int]]]] = [{0: (0, [])}]
    for s in range(1, n_stages + 1):
        row: dict[int, tuple[int, list[int]]] = {}
        # Leave at least one layer for each of the remaining stages.
        for i in range(s, n - (n_stages - s) + 1):
            for j, (prev_max, splits) in best[s - 1].items():
                if j >= i:
                    continue
                candidate = max(prev_max, cost(j, i))
                if i not in row or candidate < row[i][0]:
                    row[i] = (candidate, splits + [j])
        best.append(row)
    bounds = best[n_stages][n][1] + [n]
    return [(bounds[k], bounds[k + 1]) for k in range(n_stages)]


def build_stage_modules(
    model_on_meta: Transformer, args: ModelArgs, ranges: list[tuple[int, int]], stage_ids: list[int]
) -> list[Transformer]:
    """Meta-device copies of the model holding only the blocks (and ends) of ``stage_ids``."""
    if args.tie_embeddings and len(ranges) > 1:
        raise ConfigError("model.tie_embeddings", True, "a tied head cannot span pipeline stages; untie it for pp > 1")
    stages = []
    for sid in stage_ids:
        start, end = ranges[sid]
        stage = copy.deepcopy(model_on_meta)
        for i in range(args.n_layers):
            if not start <= i < end:
                del stage.layers[str(i)]
        if sid != 0:
            stage.tok_embeddings = None
        if sid != len(ranges) - 1:
            stage.norm = None
            stage.output = None
        stages.append(stage)
    return stages


def stage_ids_for_rank(pp_rank: int, pp_size: int, virtual_stages: int, schedule: str) -> list[int]:
    """Stages this rank runs: V-shape (r, 2*pp-1-r) for ZBV, else loop (r, r+pp, ...)."""
    if schedule == "zero_bubble" and virtual_stages == 2:
        # Must match torch's generate_stage_to_rank_mapping(style="v") used by ZBV.
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(virtual_stages)]


def check_schedule(schedule: str, pp_size: int, microbatches: int, virtual_stages: int) -> None:
    """ConfigError for combinations torch 2.13's schedules reject (or would hang on): the rule
    :func:`isthmus.layout.rules.pipeline_schedule`, which the planner's search also applies."""
    rules.raise_for(rules.pipeline_schedule(schedule, pp_size, microbatches, virtual_stages))


def build_pipeline(
    model_on_meta: Transformer,
    args: ModelArgs,
    pp_group: dist.ProcessGroup,
    pp_rank: int,
    pp_size: int,
    schedule: str,
    microbatches: int,
    virtual_stages: int,
    loss_fn: LossFn,
    device: torch.device,
    seq_len: int,
    prepare_stage: PrepareStage | None = None,
    seed: int = 0,
) -> tuple[_PipelineSchedule, list[Transformer], bool, bool]:
    """Split, materialise and schedule this rank's stages: (schedule, stages, has_first, has_last).

    ``prepare_stage`` turns each meta stage module into the module the stage runs
    (apply TP / activation checkpointing / FSDP, then ``to_empty`` + ``init_weights``)
    before its PipelineStage is built; the default only materialises on ``device`` and
    initialises with ``seed``. It runs here because PipelineStage must wrap the final,
    wrapped module: it detects FSDP on ``submod`` to defer gradient reduction.

    ``loss_fn(logits, targets)`` must return the *mean* over its micro-batch; the
    schedule keeps ``scale_grads=True`` and so averages over micro-batches itself.
    """
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    check_schedule(schedule, pp_size, microbatches, virtual_stages)
    assert dist.get_rank(pp_group) == pp_rank and dist.get_world_size(pp_group) == pp_size
    n_stages = pp_size * virtual_stages
    ranges = partition_layers(args, n_stages, seq_len)
    stage_ids = stage_ids_for_rank(pp_rank, pp_size, virtual_stages, schedule)
    modules = build_stage_modules(model_on_meta, args, ranges, stage_ids)

    def materialise(module: Transformer) -> Transformer:
        module.to_empty(device=device)
        init_weights(module, seed, args)
        return module

    prepare = prepare_stage or materialise
    modules = [prepare(m) for m in modules]
    stages = [
        PipelineStage(m, sid, n_stages, device, group=pp_group) for m, sid in zip(modules, stage_ids, strict=True)
    ]
    if schedule in ("gpipe", "1f1b"):
        single = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        sched: _PipelineSchedule = single(stages[0], microbatches, loss_fn=loss_fn, scale_grads=True)
    else:
        if schedule == "interleaved_1f1b":
            multi: type = ScheduleInterleaved1F1B
        else:
            multi = ScheduleZBVZeroBubble if virtual_stages == 2 else ScheduleInterleavedZeroBubble
        sched = multi(stages, microbatches, loss_fn=loss_fn, scale_grads=True)
    return sched, modules, 0 in stage_ids, n_stages - 1 in stage_ids


def _check_even_split(batch: Tensor | None, microbatches: int) -> None:
    # Unequal micro-batches would weight their per-micro-batch means unequally.
    if batch is not None and batch.shape[0] % microbatches:
        raise ConfigError("parallel.microbatches", microbatches, f"must divide the local batch size {batch.shape[0]}")


def after_each_step(schedule: _PipelineSchedule, then: Callable[[], None]) -> None:
    """Run ``then`` after every ``schedule.step`` (training steps; `pipeline_eval` does not step)."""
    step = schedule.step

    def step_then(*args: Any, **kwargs: Any) -> Any:
        out = step(*args, **kwargs)
        then()
        return out

    schedule.step = step_then  # type: ignore[method-assign]


def local_stages(schedule: _PipelineSchedule) -> list[PipelineStage]:
    # torch keeps a rank's stages in `_stage` (single-stage) or `_stages` (multi-stage).
    return list(getattr(schedule, "_stages", None) or [schedule._stage])  # type: ignore[attr-defined]


def crosses_datacenters(a: int, b: int, pp: int, datacenters: int) -> bool:
    """Whether pipeline ranks ``a`` and ``b`` lie in different datacenters (``geo.dc_axis = pp``:
    datacenter d holds pp ranks d * pp / datacenters onwards)."""
    per_dc = pp // datacenters
    return a // per_dc != b // per_dc


def count_cross_dc_sends(schedule: _PipelineSchedule, pp: int, datacenters: int, counter: dict[str, int]) -> int:
    """Count, in ``counter["wan"]``, the bytes this rank's stages exchange with stages in another
    datacenter (``geo.dc_axis = pp``: datacenter d holds pp ranks d * pp / datacenters onwards).

    Each local stage whose next stage lives in another datacenter has its ``forward_one_chunk``
    wrapped (the schedule calls it once per micro-batch; the stage's one-off metadata inference
    runs the module directly and sends only shapes, so a module forward hook would over-count):
    its output's bytes are added twice per training micro-batch, the activation it sends and the
    gradient of the same shape that comes back. Forward-only validation sends are not counted.
    Returns how many local stages are wrapped.
    """
    hooked = 0
    for st in local_stages(schedule):
        nxt = st.stage_index_to_group_rank.get(st.stage_index + 1)
        here = st.stage_index_to_group_rank[st.stage_index]
        if nxt is None or not crosses_datacenters(here, nxt, pp, datacenters):
            continue
        st.forward_one_chunk = _counting(st.forward_one_chunk, counter)  # type: ignore[method-assign]
        hooked += 1
    return hooked


def _counting(forward: Callable[..., Any], counter: dict[str, int]) -> Callable[..., Any]:
    def forward_one_chunk(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        if torch.is_grad_enabled():  # validation: forward only, not a training step's traffic
            tensors = out if isinstance(out, (tuple, list)) else (out,)
            counter["wan"] += 2 * sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))
        return out

    return forward_one_chunk


def pipeline_step(
    schedule: _PipelineSchedule, inputs: Tensor, targets: Tensor, has_first: bool, has_last: bool
) -> Tensor | None:
    """Forward + backward of one local batch; the mean micro-batch loss on the last stage's rank.

    Ranks without the first (last) stage may pass anything as ``inputs`` (``targets``);
    gradients are left in ``.grad`` for the optimizer. Other ranks get None: broadcast
    the loss from the last stage's rank for logging.
    """
    n_mb = schedule._n_microbatches
    _check_even_split(inputs if has_first else None, n_mb)
    _check_even_split(targets if has_last else None, n_mb)
    losses: list[Tensor] = []
    args = (inputs,) if has_first else ()
    kwargs: dict[str, Any] = {"target": targets, "losses": losses} if has_last else {}
    # return_outputs=False: the logits are only needed for the loss, which torch keeps.
    schedule.step(*args, return_outputs=False, **kwargs)
    return torch.stack([loss.detach() for loss in losses]).mean() if has_last else None


@torch.no_grad()
def pipeline_eval(
    schedule: _PipelineSchedule, inputs: Tensor, targets: Tensor, has_first: bool, has_last: bool
) -> Tensor | None:
    """Forward-only mean loss of one batch, on the last stage's rank (None elsewhere).

    Not ``schedule.eval``: in torch 2.13 it replays the training action list, and for
    ZBV the hand-off between the two stages on one rank asserts during the (skipped)
    backward actions. Instead each rank runs its stages in increasing order, every
    micro-batch of a stage before the next stage: a stage only waits on a lower stage,
    so the order cannot deadlock, and non-blocking sends let ranks overlap. Each
    activation travels after a small header with its shape and dtype, because the
    receiving rank may hold neither the inputs nor the targets.
    """
    stages = sorted(local_stages(schedule), key=lambda st: st.stage_index)
    n_mb, loss_fn = schedule._n_microbatches, schedule._loss_fn
    assert loss_fn is not None
    _check_even_split(inputs if has_first else None, n_mb)
    _check_even_split(targets if has_last else None, n_mb)
    local: dict[int, list[Tensor]] = {}  # stage index -> its micro-batch outputs
    pending: list[tuple[dist.Work | None, Tensor]] = []
    losses: list[Tensor] = []
    for st in stages:
        prev_rank = st.stage_index_to_group_rank.get(st.stage_index - 1)
        next_rank = st.stage_index_to_group_rank.get(st.stage_index + 1)
        microbatches = inputs.tensor_split(n_mb) if st.is_first else [None] * n_mb
        outputs = []
        for m in range(n_mb):
            if st.is_first:
                x = microbatches[m]
            elif prev_rank == st.group_rank:
                x = local[st.stage_index - 1][m]
            else:
                assert st.group is not None and prev_rank is not None  # a stage on another rank has both
                x = _recv_activation(st.group, prev_rank, st.device)
            out = st.submod(x)
            if st.is_last:
                losses.append(loss_fn(out, targets.tensor_split(n_mb)[m]))
            elif next_rank == st.group_rank:
                outputs.append(out)
            else:
                assert st.group is not None and next_rank is not None
                pending.extend(_send_activation(out, st.group, next_rank))
        local[st.stage_index] = outputs
    for work, _ in pending:
        if work is not None:  # (None only when this rank is not in the group, which a stage's rank always is)
            work.wait()
    return torch.stack(losses).mean() if has_last else None


def _send_activation(x: Tensor, group: dist.ProcessGroup, peer: int) -> list[tuple[dist.Work | None, Tensor]]:
    assert x.dim() < HEADER_LEN - 1 and x.dtype in DTYPES
    header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=x.device)
    header[0], header[1] = DTYPES.index(x.dtype), x.dim()
    header[2 : 2 + x.dim()] = torch.tensor(x.shape)
    payload = x.contiguous()
    # Returned with their works so both buffers outlive the asynchronous sends.
    return [(dist.isend(t, group=group, group_dst=peer), t) for t in (header, payload)]


def _recv_activation(group: dist.ProcessGroup, peer: int, device: torch.device) -> Tensor:
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=peer)
    dtype, ndim = DTYPES[int(header[0])], int(header[1])
    x = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(x, group=group, group_src=peer)
    return x
