"""What the planner reasons about: the workload, one candidate layout, and the runtime's habits.

A :class:`Layout` is one way to run a :class:`Workload` on a topology: the parallel degrees and
schedule (the fields of ``ParallelConfig``) plus where datacenter boundaries fall and how data
parallelism crosses them. A :class:`Runtime` holds the assumptions about the software that runs it
(attention kernel, dropout, what overlaps with what, bytes per parameter), so the same cost model
can describe isthmus itself and the Megatron-LM of 2021 that published Table 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from isthmus.models.args import ModelArgs

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]
Recompute = Literal["none", "selective", "full"]
DcAxis = Literal["none", "dp", "pp"]
GeoStrategy = Literal["none", "flat", "hierarchical", "compressed", "diloco", "streaming_diloco"]
GEO_STRATEGIES: tuple[GeoStrategy, ...] = ("flat", "hierarchical", "compressed", "diloco", "streaming_diloco")
DILOCO_KINDS: tuple[GeoStrategy, ...] = ("diloco", "streaming_diloco")


@dataclass(frozen=True)
class Workload:
    """What to train: the model shape and the training shape of one optimizer step."""

    args: ModelArgs
    global_batch: int
    """Sequences per optimizer step."""
    seq_len: int
    dtype: str = "bf16"
    """Compute dtype of the matmuls (selects the device's peak)."""

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


@dataclass(frozen=True)
class Layout:
    """One candidate: ``ParallelConfig`` degrees plus cross-datacenter placement and strategy."""

    tp: int = 1
    sp: bool = False
    cp: int = 1
    cp_impl: Literal["ring", "ulysses"] = "ring"
    pp: int = 1
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1
    dp_replicate: int = 1
    """Replicas, including the datacenter factor when ``dc_axis == 'dp'``."""
    dp_shard: int = 1
    zero_stage: int = 1
    micro_batch: int = 1
    """Sequences per microbatch."""
    microbatches: int = 1
    """Microbatches per step per pipeline (gradient accumulation when pp == 1)."""
    recompute: Recompute = "none"
    dc: int = 1
    """Datacenters the layout spans."""
    dc_axis: DcAxis = "none"
    """Which dimension the datacenter boundary cuts: data-parallel replicas or pipeline stages."""
    geo: GeoStrategy = "none"
    """How data-parallel gradients cross datacenters (dc_axis == 'dp')."""
    diloco_h: int = 0
    """Inner steps between DiLoCo outer synchronisations (of each fragment, for streaming_diloco)."""
    fragments: int = 4
    """streaming_diloco: fragments synchronised in turn, one every diloco_h / fragments steps."""
    overlap_steps: int = 1
    """streaming_diloco: inner steps a fragment's transfer overlaps before its result is applied."""

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def shard_degree(self) -> int:
        """Ranks one FSDP/ZeRO shard group spans: dp_shard x cp (isthmus shards over dp_shard_cp)."""
        return self.dp_shard * self.cp if self.dp_shard > 1 or (self.cp > 1 and (self.tp > 1 or self.pp > 1)) else 1

    @property
    def grad_sync_degree(self) -> int:
        """Ranks holding replicas of the same parameters: dp x cp."""
        return self.dp * self.cp

    def parallel_config(self) -> dict[str, object]:
        """The ``[parallel]`` section this layout runs as (the one hand-off to the runtime)."""
        return {
            "nproc": self.world,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "zero_stage": self.zero_stage,
            "tp": self.tp,
            "sequence_parallel": self.sp,
            "cp": self.cp,
            "cp_impl": self.cp_impl,
            "pp": self.pp,
            "pp_schedule": self.schedule,
            "microbatches": self.microbatches if self.pp > 1 else 1,
            "pp_virtual_stages": self.virtual_stages,
            "activation_checkpoint": self.recompute,
        }

    def train_config(self, work: Workload) -> dict[str, object]:
        """The ``[train]`` keys the layout implies: microbatches are gradient accumulation without pp."""
        return {"batch_size": work.global_batch, "seq_len": work.seq_len,
                "grad_accum": self.microbatches if self.pp == 1 else 1}

    def model_overrides(self, args: ModelArgs) -> dict[str, object]:
        """``[model]`` keys the runtime needs: isthmus unties a tied head from a pipelined embedding."""
        return {"tie_embeddings": False} if self.pp > 1 and args.tie_embeddings else {}

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def label(self) -> str:
        """A compact one-line description, e.g. ``tp8 sp pp12/dc zb v2 dp32 z2 mb1x48 ac-full``."""
        parts = [f"tp{self.tp}" + (" sp" if self.sp else "")]
        if self.cp > 1:
            parts.append(f"cp{self.cp}{'u' if self.cp_impl == 'ulysses' else ''}")
        if self.pp > 1:
            sched = {"interleaved_1f1b": f"i1f1b v{self.virtual_stages}", "zero_bubble": f"zb v{self.virtual_stages}"}
            parts.append(f"pp{self.pp}" + ("/dc" if self.dc_axis == "pp" else "") + " " + sched.get(self.schedule, self.schedule))
        dp = f"dp{self.dp}"
        if self.dp_replicate > 1 and self.dp_shard > 1:
            dp += f"(r{self.dp_replicate} s{self.dp_shard})"
        if self.shard_degree > 1:
            dp += f" z{self.zero_stage}"
        if self.dc_axis == "dp":
            dp += "/dc " + {"diloco": f"diloco H{self.diloco_h}",
                            "streaming_diloco": f"sdiloco H{self.diloco_h} F{self.fragments} t{self.overlap_steps}",
                            }.get(self.geo, self.geo)
        parts.append(dp)
        parts.append(f"mb{self.micro_batch}x{self.microbatches}")
        if self.recompute != "none":
            parts.append(f"ac-{self.recompute}")
        return " ".join(parts)


@dataclass(frozen=True)
class Runtime:
    """Assumptions about the training software; every one is listed in docs/planner.md."""

    name: str
    attention: Literal["flash", "materialized"]
    """flash: fused attention, no S x S tensor; materialized: softmax over a stored S x S score matrix."""
    dropout: bool
    """Dropout on attention probabilities and after each residual branch (masks cost memory and time)."""
    dp_overlap: bool
    """Gradient reduction overlaps the backward of the last microbatch; parameter gathers overlap forward."""
    p2p_async: bool
    """Pipeline sends overlap compute (a link is its own pipeline stage) rather than blocking the sender."""
    scatter_gather: bool
    """Pipeline activations are split across the tensor-parallel ranks, each sending 1/tp (Megatron)."""
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    """Bytes per parameter of weights, gradients and optimizer state (master copy + Adam moments)."""
    compress_ratio: float = 0.25
    """Bytes sent over the WAN by the 'compressed' strategy, relative to the gradient's own bytes."""
    quality: tuple[tuple[str, float], ...] = (("compressed", 0.98), ("diloco", 0.9), ("streaming_diloco", 0.9))
    """Assumed tokens-to-same-loss factor of lossy cross-datacenter strategies (ranking only)."""

    def quality_of(self, geo: str) -> float:
        return dict(self.quality).get(geo, 1.0)


RUNTIMES: dict[str, Runtime] = {
    # isthmus on torch 2.13: SDPA (flash on GPU), no dropout, FSDP2/DDP overlap gradient
    # reduction with backward, pipelining isend/irecv, fp32 parameters under bf16 autocast.
    "isthmus": Runtime(
        "isthmus", attention="flash", dropout=False, dp_overlap=True, p2p_async=True, scatter_gather=False,
        weight_bytes=4, grad_bytes=4, optimizer_bytes=8,
    ),
    # Megatron-LM as in Narayanan et al. 2021: fp16 with fused softmax over a materialised score
    # matrix, dropout 0.1, gradient all-reduce after the last backward, blocking p2p with the
    # scatter/gather optimisation, ZeRO-paper state accounting (2 + 2 + 12 bytes per parameter).
    "megatron-2021": Runtime(
        "megatron-2021", attention="materialized", dropout=True, dp_overlap=False, p2p_async=False,
        scatter_gather=True, weight_bytes=2, grad_bytes=2, optimizer_bytes=12,
    ),
}
