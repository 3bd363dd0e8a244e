"""`LayoutSpec`: one parallel layout, in the config's own words.

Every field is named after the config key it sets (``parallel.*``, ``geo.*``), so the planner's
candidates, the simulator's input, ``isthmus plan --json`` and a run's config speak one
vocabulary. The choices of the keys that take a word (pipeline schedules, context-parallel
kinds, recomputation modes, cross-datacenter sync kinds) are defined here once; the config, the
planner and the runtime import them.

Two quantities differ from a config value, and are documented where they are defined:

- ``micro_batch`` (sequences per microbatch) has no config key: the runtime derives it as
  ``train.batch_size / (dp x microbatches)``. It is the planner's name, and the only one.
- ``microbatches`` counts the microbatches of one step of one pipeline. With ``pp > 1`` that is
  ``parallel.microbatches``; with ``pp == 1`` it is gradient accumulation, ``train.grad_accum``
  (:meth:`LayoutSpec.config_overrides` writes whichever applies).
- ``dp_replicate`` is, as in the config, the replicas inside one datacenter; with
  ``dc_axis == 'dp'`` the layout has ``datacenters`` times as many (:attr:`LayoutSpec.replicas`).
- ``dc_axis`` is ``'none'`` for a layout in one datacenter (the config's ``geo.datacenters = 1``).

Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from isthmus.layout.choices import ActivationCheckpoint, CpImpl, DcAxis, PpSchedule, SyncKind, WanSchedule
from isthmus.layout.dims import ParallelDims
from isthmus.layout.rules import DataParallelKind, data_parallel_kind, shard_degree
from isthmus.layout.sections import LayoutConfig

__all__ = ["DERIVED", "GEO_KEYS", "PARALLEL_KEYS", "LayoutSpec"]

PARALLEL_KEYS = (
    "dp_replicate",
    "dp_shard",
    "zero_stage",
    "tp",
    "sequence_parallel",
    "cp",
    "cp_impl",
    "pp",
    "pp_schedule",
    "pp_virtual_stages",
    "microbatches",
    "activation_checkpoint",
)
"""The ``[parallel]`` keys a layout sets (besides ``nproc``, its world size)."""
GEO_KEYS = (
    "datacenters",
    "dc_axis",
    "sync",
    "inner_steps",
    "fragments",
    "overlap_steps",
    "wan_schedule",
    "wan_streams",
)
"""The ``[geo]`` keys a layout sets."""
DERIVED = ("micro_batch",)
"""Fields with no config key (see the module docstring)."""


@dataclass(frozen=True)
class LayoutSpec:
    """One layout: ``[parallel]`` degrees and schedule, ``[geo]`` placement and sync, the microbatch size."""

    dp_replicate: int = 1
    """Replicas (DDP) inside one datacenter; see :attr:`replicas` for all of them."""
    dp_shard: int = 1
    """Sharded data-parallel degree (ZeRO / FSDP)."""
    zero_stage: int = 1
    """What dp_shard shards: 1 optimizer state, 2 + gradients, 3 + parameters."""
    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    cp_impl: CpImpl = "ring"
    pp: int = 1
    pp_schedule: PpSchedule = "1f1b"
    pp_virtual_stages: int = 1
    microbatches: int = 1
    """Microbatches per step per pipeline: parallel.microbatches with pp > 1, train.grad_accum without."""
    activation_checkpoint: ActivationCheckpoint = "none"
    datacenters: int = 1
    """Datacenters the layout spans."""
    dc_axis: DcAxis = "none"
    """Which dimension the datacenter boundary cuts: data-parallel replicas or pipeline stages."""
    sync: SyncKind = "none"
    """How data-parallel gradients cross datacenters (dc_axis == 'dp')."""
    inner_steps: int = 50
    """diloco / streaming_diloco: inner steps between two syncs of the same parameters."""
    fragments: int = 4
    """streaming_diloco: fragments synchronised in turn, one every inner_steps / fragments steps."""
    overlap_steps: int = 1
    """streaming_diloco: inner steps a fragment's transfer overlaps before its result is applied."""
    wan_schedule: WanSchedule = "fair"
    """dc_axis == 'pp': how the pipelines crossing one WAN link share it (fair: at once; time_shared: in turn)."""
    wan_streams: int = 1
    """TCP connections one cross-datacenter transfer is split over (each carries at most window / RTT)."""
    micro_batch: int = 1
    """Derived, no config key: sequences per microbatch (train.batch_size / (dp x microbatches))."""

    # --- degrees -------------------------------------------------------------------------------

    @property
    def replicas(self) -> int:
        """Every replica: ``dp_replicate``, times the datacenters when ``dc_axis == 'dp'``."""
        return self.dp_replicate * (self.datacenters if self.dc_axis == "dp" else 1)

    @property
    def dp(self) -> int:
        """Data-parallel degree over the whole layout (datacenters included)."""
        return self.replicas * self.dp_shard

    @property
    def world(self) -> int:
        """Ranks the layout runs on: ``parallel.nproc``."""
        return self.tp * self.cp * self.pp * self.dp

    @property
    def shard_degree(self) -> int:
        """Ranks one FSDP/ZeRO shard group spans (see :func:`isthmus.layout.rules.shard_degree`)."""
        return shard_degree(self.dp_shard, self.cp, self.tp, self.pp)

    @property
    def data_parallel_kind(self) -> DataParallelKind:
        """What keeps the replicas in step (see :func:`isthmus.layout.rules.data_parallel_kind`)."""
        return data_parallel_kind(
            self.dp_shard, self.cp, self.tp, self.pp, self.replicas, self.zero_stage, self.sync != "none"
        )

    @property
    def grad_sync_degree(self) -> int:
        """Ranks holding replicas of the same parameters: dp x cp."""
        return self.dp * self.cp

    @property
    def global_batch(self) -> int:
        """Sequences per step: ``train.batch_size``."""
        return self.dp * self.micro_batch * self.microbatches

    def dims(self) -> ParallelDims:
        """The degrees as the runtime's :class:`ParallelDims` (build its mesh with ``build_mesh``)."""
        dc = self.datacenters if self.dc_axis == "dp" else 1
        return ParallelDims(self.dp_replicate, self.dp_shard, self.cp, self.tp, self.pp, self.world, dc)

    # --- conversions ---------------------------------------------------------------------------

    @classmethod
    def from_config(cls, cfg: LayoutConfig) -> LayoutSpec:
        """The layout a resolved ``JobConfig`` runs (data-parallel degrees of -1 must be filled first).

        Raises ValueError for what one spec cannot say: pipeline microbatches and gradient
        accumulation together (``parallel.pp > 1`` with ``train.grad_accum > 1``).
        """
        p, g, t = cfg.parallel, cfg.geo, cfg.train
        if p.dp_replicate < 1 or p.dp_shard < 1:
            raise ValueError("fill the data-parallel degrees (-1) before taking the layout")
        if p.pp > 1 and t.grad_accum > 1:
            raise ValueError("a layout has pipeline microbatches or gradient accumulation, not both")
        axis: DcAxis = g.dc_axis if g.datacenters > 1 else "none"
        microbatches = p.microbatches if p.pp > 1 else t.grad_accum
        dp = p.dp_replicate * (g.datacenters if axis == "dp" else 1) * p.dp_shard
        return cls(
            dp_replicate=p.dp_replicate,
            dp_shard=p.dp_shard,
            zero_stage=p.zero_stage,
            tp=p.tp,
            sequence_parallel=p.sequence_parallel,
            cp=p.cp,
            cp_impl=p.cp_impl,
            pp=p.pp,
            pp_schedule=p.pp_schedule,
            pp_virtual_stages=p.pp_virtual_stages,
            microbatches=microbatches,
            activation_checkpoint=p.activation_checkpoint,
            datacenters=g.datacenters,
            dc_axis=axis,
            sync=g.sync,
            inner_steps=g.inner_steps,
            fragments=g.fragments,
            overlap_steps=g.overlap_steps,
            wan_schedule=g.wan_schedule,
            wan_streams=g.wan_streams,
            micro_batch=max(1, t.batch_size // max(1, dp * microbatches)),
        )

    def config_overrides(self, batch: bool = True) -> dict[str, object]:
        """``section.key -> value`` for every config key the layout sets (``parallel.nproc`` included).

        ``batch``: also ``train.batch_size`` (dp x micro_batch x microbatches); ``train.grad_accum``
        is always written (the layout's microbatches without a pipeline, else 1).
        """
        out: dict[str, object] = {"parallel.nproc": self.world}
        for key in PARALLEL_KEYS:
            out[f"parallel.{key}"] = getattr(self, key)
        out["parallel.microbatches"] = self.microbatches if self.pp > 1 else 1
        out["train.grad_accum"] = self.microbatches if self.pp == 1 else 1
        if batch:
            out["train.batch_size"] = self.global_batch
        out["geo.datacenters"] = self.datacenters
        out["geo.dc_axis"] = "dp" if self.dc_axis == "none" else self.dc_axis
        for key in ("sync", "inner_steps", "fragments", "overlap_steps", "wan_schedule", "wan_streams"):
            out[f"geo.{key}"] = getattr(self, key)
        return out

    def config_sections(
        self, seq_len: int | None = None, tie_embeddings: bool | None = None
    ) -> dict[str, dict[str, object]]:
        """:meth:`config_overrides` as ``{section: {key: value}}`` (the form ``isthmus plan --json`` prints),
        with ``train.seq_len`` when given, and ``model.tie_embeddings = false`` when a tied head is pipelined
        (isthmus unties it: embedding and head live on different stages)."""
        out: dict[str, dict[str, object]] = {"parallel": {}, "geo": {}, "train": {}, "model": {}}
        for dotted, value in self.config_overrides().items():
            section, key = dotted.split(".", 1)
            out[section][key] = value
        if seq_len is not None:
            out["train"]["seq_len"] = seq_len
        if tie_embeddings and self.pp > 1:
            out["model"]["tie_embeddings"] = False
        return out

    def parallel_config(self) -> dict[str, object]:
        """The ``[parallel]`` keys of :meth:`config_overrides` (without the section)."""
        return {k.split(".", 1)[1]: v for k, v in self.config_overrides().items() if k.startswith("parallel.")}

    def as_dict(self) -> dict[str, object]:
        """Every field by its name (the JSON ``isthmus plan`` prints as ``layout``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayoutSpec:
        """The inverse of :meth:`as_dict`; unknown keys raise ValueError."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"not a layout field: {', '.join(unknown)} (fields: {', '.join(sorted(names))})")
        return cls(**data)

    def with_(self, **changes: Any) -> LayoutSpec:
        return replace(self, **changes)

    def manifest(self, world_size: int, summary: str) -> dict[str, object]:
        """The ``layout`` a checkpoint manifest records (``isthmus.json``; see train.checkpoint_manifest)."""
        return {
            "summary": summary,
            "world_size": world_size,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "zero_stage": self.zero_stage,
            "tp": self.tp,
            "sequence_parallel": self.sequence_parallel,
            "cp": self.cp,
            "cp_impl": self.cp_impl,
            "pp": self.pp,
            "pp_schedule": self.pp_schedule,
            "pp_virtual_stages": self.pp_virtual_stages,
            "microbatches": self.microbatches if self.pp > 1 else 1,
            "datacenters": self.datacenters,
            "dc_axis": "dp" if self.dc_axis == "none" else self.dc_axis,
            "sync": self.sync,
        }

    def label(self) -> str:
        """A compact one-line description, e.g. ``tp8 sp pp12/dc zb v2 dp32 z2 mb1x48 ac-full``."""
        parts = [f"tp{self.tp}" + (" sp" if self.sequence_parallel else "")]
        if self.cp > 1:
            parts.append(f"cp{self.cp}{'u' if self.cp_impl == 'ulysses' else ''}")
        if self.pp > 1:
            sched = {
                "interleaved_1f1b": f"i1f1b v{self.pp_virtual_stages}",
                "zero_bubble": f"zb v{self.pp_virtual_stages}",
            }
            parts.append(
                f"pp{self.pp}"
                + ("/dc" if self.dc_axis == "pp" else "")
                + " "
                + sched.get(self.pp_schedule, self.pp_schedule)
                + (" ts" if self.wan_schedule == "time_shared" else "")
            )
        dp = f"dp{self.dp}"
        # The split shows whenever replicas and sharding meet, sharding over cp alone (dp_shard 1)
        # included: otherwise dp128 z3 would name both dp_shard 128 and dp_replicate 128 with cp 4.
        if self.replicas > 1 and (self.dp_shard > 1 or self.shard_degree > 1):
            dp += f"(r{self.replicas} s{self.dp_shard})"
        if self.shard_degree > 1:
            dp += f" z{self.zero_stage}"
        if self.dc_axis == "dp":
            dp += "/dc " + {
                "diloco": f"diloco H{self.inner_steps}",
                "streaming_diloco": f"sdiloco H{self.inner_steps} F{self.fragments} t{self.overlap_steps}",
            }.get(self.sync, self.sync)
        parts.append(dp)
        parts.append(f"mb{self.micro_batch}x{self.microbatches}")
        if self.activation_checkpoint != "none":
            parts.append(f"ac-{self.activation_checkpoint}")
        return " ".join(parts)
