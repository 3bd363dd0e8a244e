"""Every layout rule, written once: each returns why a layout cannot run (a :class:`Reason`), or None.

The runtime raises a reason as ``ConfigError(reason.key, reason.value, reason)`` (see
:func:`raise_for`), naming the config key that breaks it; the planner's search skips a candidate
whose rule returns a reason. Pure Python: no torch.
"""

from __future__ import annotations

from typing import Literal

from isthmus.errors import ConfigError
from isthmus.layout.choices import PP_SCHEDULES


class Reason(str):
    """Why a layout cannot run, in words, with the config key (and its value) that breaks the rule."""

    key: str
    value: object

    def __new__(cls, key: str, value: object, rule: str) -> Reason:
        self = super().__new__(cls, rule)
        self.key, self.value = key, value
        return self


def raise_for(reason: Reason | None) -> None:
    """The runtime's form of a rule: ConfigError naming the key, the value and the rule."""
    if reason is not None:
        raise ConfigError(reason.key, reason.value, str(reason))


def pipeline_schedule(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> Reason | None:
    """(schedule, pp, microbatches, virtual stages) that torch 2.13's schedules reject, or would hang on.

    With ``pp == 1`` there is no schedule: only more than one virtual stage is wrong.
    """
    if pp == 1:
        if virtual_stages > 1:
            return Reason("parallel.pp_virtual_stages", virtual_stages, "needs parallel.pp > 1")
        return None
    if schedule not in PP_SCHEDULES:
        return Reason("parallel.pp_schedule", schedule, f"choose one of: {', '.join(PP_SCHEDULES)}")
    if schedule in ("gpipe", "1f1b") and virtual_stages != 1:
        return Reason("parallel.pp_virtual_stages", virtual_stages, f"{schedule} runs one stage per rank; use 1")
    if schedule in ("interleaved_1f1b", "zero_bubble") and virtual_stages < 2:
        return Reason("parallel.pp_virtual_stages", virtual_stages, f"{schedule} needs >= 2 stages per rank")
    if microbatches < 1:
        return Reason("parallel.microbatches", microbatches, "must be >= 1")
    if schedule == "1f1b" and microbatches < pp:
        return Reason("parallel.microbatches", microbatches, f"1f1b needs >= pp = {pp} micro-batches")
    rounds = max(1, microbatches // pp)
    interleaved = schedule == "interleaved_1f1b" or (schedule == "zero_bubble" and virtual_stages > 2)
    if interleaved and microbatches % rounds:
        # torch's flexible interleaving runs rounds of microbatches // pp micro-batches.
        return Reason(
            "parallel.microbatches", microbatches, f"{schedule} needs a multiple of max(1, mb // pp) = {rounds}"
        )
    return None


def pipeline_stages(pp: int, virtual_stages: int, n_layers: int) -> Reason | None:
    """Every pipeline stage holds at least one block."""
    if pp * virtual_stages > n_layers:
        return Reason(
            "parallel.pp",
            pp,
            f"pp * pp_virtual_stages = {pp * virtual_stages} stages is more than model.n_layers = {n_layers}",
        )
    return None


DataParallelKind = Literal["none", "ddp", "zero1", "fsdp"]


def data_parallel_kind(
    dp_shard: int, cp: int, tp: int, pp: int, replicas: int, zero_stage: int, geo_sync: bool = False, ep: int = 1
) -> DataParallelKind:
    """How the runtime keeps data-parallel (and context-parallel) replicas in step.

    ``replicas``: every replica, datacenters included. Under a geo sync the strategy averages
    over replicas itself (isthmus.geo) and FSDP2 shards inside each datacenter only. DDP holds
    neither DTensor parameters (tp, expert parallelism's experts) nor pipeline stages run
    microbatch by microbatch (pp): FSDP2 with a shard size of 1 is pure replication and composes
    with all of them. ZeRO-1 is DDP with a sharded optimizer ("zero1") for dp_shard alone, and
    FSDP2 replicating the weights with a sharded optimizer (:func:`sharded_optimizer`) next to
    tp, pp, cp or replicas.
    """
    if geo_sync:
        return "fsdp" if dp_shard > 1 or ep > 1 else "none"
    alone = tp == 1 and pp == 1 and cp == 1 and replicas == 1
    if dp_shard > 1 and zero_stage == 1 and ep == 1 and alone:
        return "zero1"
    grad_sync = replicas * dp_shard * cp
    if dp_shard > 1 or ep > 1 or ((tp > 1 or pp > 1) and grad_sync > 1):
        return "fsdp"
    return "ddp" if grad_sync > 1 else "none"


ComputePrecision = Literal["fp32", "fsdp_mixed_precision", "autocast"]


def compute_precision(dtype: str, kind: DataParallelKind) -> ComputePrecision:
    """How a layout computes under ``train.dtype``: bf16 through FSDP2's mixed precision where FSDP2
    holds the weights (bf16 copies gathered over fp32 sharded masters, fp32 reductions; autocast's
    cast cache would keep a bf16 copy of every gathered weight), under ``torch.autocast`` elsewhere.
    The runtime applies it (`isthmus.parallel.parallelize`), the planner counts it (its memory model)."""
    if dtype != "bf16":
        return "fp32"
    return "fsdp_mixed_precision" if kind == "fsdp" else "autocast"


def shard_degree(dp_shard: int, cp: int, tp: int, pp: int) -> int:
    """Ranks one FSDP/ZeRO shard group spans: dp_shard x cp (isthmus shards over dp_shard_cp) when
    :func:`data_parallel_kind` shards, else 1 (DDP over context-parallel ranks replicates)."""
    kind = data_parallel_kind(dp_shard, cp, tp, pp, replicas=1, zero_stage=2)
    return dp_shard * cp if kind == "fsdp" else 1


def sharded_optimizer(kind: DataParallelKind, zero_stage: int, dp_shard: int, cp: int) -> bool:
    """Whether FSDP2 replicates the weights and gradients over dp_shard x cp while each rank of that
    group steps the optimizer state of its own parameters only (ZeRO-1, Megatron's distributed
    optimizer), as ``zero_stage`` 1 runs next to tp, pp, cp or replicas."""
    return kind == "fsdp" and zero_stage == 1 and dp_shard * cp > 1


def zero_stage(
    stage: int, dp_shard: int, tp: int, pp: int, cp: int, replicas: int, geo_sync: bool = False
) -> Reason | None:
    """ZeRO-1 composes with tp, pp, cp and replicas, not with a cross-datacenter strategy.

    ``replicas``: every replica, datacenters included (dp_replicate x datacenters on dc_axis dp).
    """
    if stage == 1 and dp_shard > 1 and geo_sync:
        return Reason("parallel.zero_stage", 1, "ZeRO-1 does not run under geo.sync; use zero_stage 2 or 3")
    return None


def zero_stages(dp_shard: int, tp: int, pp: int, cp: int, replicas: int) -> tuple[int, ...]:
    """The ZeRO stages that make different runs: 1 alone when nothing is sharded, else all three
    (ZeRO-1 is DDP with a sharded optimizer for dp_shard alone, FSDP2 replication with a sharded
    optimizer next to tp, pp, cp or replicas)."""
    if shard_degree(dp_shard, cp, tp, pp) == 1:
        return (1,)
    return (1, 2, 3)


def divides_world(key: str, degree: int, world: int) -> Reason | None:
    """A parallel degree divides the ranks (``key``: dp_replicate, dp_shard, tp, cp or pp)."""
    if world % degree:
        return Reason(f"parallel.{key}", degree, f"must divide parallel.nproc = {world}")
    return None


def tensor_parallel_heads(tp: int, n_heads: int, n_kv_heads: int) -> Reason | None:
    """Tensor parallelism splits whole attention heads, query and key/value alike."""
    for heads, name in ((n_heads, "n_heads"), (n_kv_heads, "n_kv_heads")):
        if heads % tp:
            return Reason("parallel.tp", tp, f"must divide model.{name} = {heads}")
    return None


def expert_parallel(ep: int, dp_shard: int, cp: int, n_experts: int) -> Reason | None:
    """Expert parallelism folds over dp_shard x cp, the data-parallel ranks of one datacenter (as
    torchtitan folds it), so experts never cross the WAN, and splits the experts evenly."""
    if ep < 1:
        return Reason("parallel.ep", ep, "must be >= 1")
    if ep == 1:
        return None
    if n_experts == 0:
        return Reason("parallel.ep", ep, "needs a MoE model (model.n_experts > 0)")
    if (dp_shard * cp) % ep:
        return Reason(
            "parallel.ep",
            ep,
            f"must divide parallel.dp_shard x parallel.cp = {dp_shard * cp}: experts stay inside a datacenter, "
            "never spread over replicas across the WAN",
        )
    if n_experts % ep:
        return Reason("parallel.ep", ep, f"must divide model.n_experts = {n_experts}")
    return None
