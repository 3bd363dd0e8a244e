"""`LayoutSpec`: one parallel layout, in the config's own words.

The layout's fields are declared here once, each named as the config key it sets and tagged with
that key's section (``parallel``, ``train`` or ``geo``; :meth:`LayoutSpec.config_key`). Whatever
else speaks of a layout builds from this record: a run's log line and checkpoint manifest
(:meth:`LayoutSpec.describe`, :meth:`LayoutSpec.manifest`), ``isthmus.parallelize``, the planner's
candidates and search space, the simulator's input, ``isthmus plan --json`` and the config keys a
plan sets (:meth:`LayoutSpec.config_overrides`). The words its keys take are in
:mod:`isthmus.layout.choices`.

Where a field is not simply its config key's value:

- ``micro_batch`` (sequences per microbatch) has no config key: the runtime derives it as
  ``train.batch_size / (dp x microbatches x grad_accum)``. It is the planner's name, and the only one.
- ``microbatches`` is a pipeline's (``parallel.microbatches``; 1 without a pipeline) and
  ``grad_accum`` is gradient accumulation (``train.grad_accum``): one name per meaning.
  :attr:`LayoutSpec.microbatches_per_step` counts both, as the cost model does.
- ``dp_replicate`` is, as in the config, the replicas inside one datacenter; with
  ``dc_axis == 'dp'`` the layout has ``datacenters`` times as many (:attr:`LayoutSpec.replicas`).
- ``dc_axis`` is ``'none'`` for a layout in one datacenter (the config's ``geo.datacenters = 1``).

Pure Python: no torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import Field, asdict, dataclass, field, fields, replace
from typing import Any

from isthmus.errors import ConfigError
from isthmus.layout.choices import (
    DILOCO_SYNCS,
    ActivationCheckpoint,
    CpImpl,
    DcAxis,
    OuterDtype,
    PpCompression,
    PpSchedule,
    SyncKind,
    WanSchedule,
)
from isthmus.layout.dims import ParallelDims
from isthmus.layout.rules import DataParallelKind, data_parallel_kind, shard_degree
from isthmus.layout.sections import LayoutConfig

__all__ = [
    "DERIVED",
    "GEO_KEYS",
    "LABEL_LEGEND",
    "PARALLEL_KEYS",
    "LabelPart",
    "LayoutSpec",
    "label_parts",
    "legend_for",
]


def _key(
    section: str | None, default: Any, *, when: Callable[[LayoutSpec], bool] | None = None, state: bool = False
) -> Any:
    """A layout field: the section of its config key (None: derived, no key); ``when``: the layouts
    it applies to, where :meth:`LayoutSpec.describe` always shows it (a field without one shows when
    it differs from its default); ``state``: it decides what each rank holds, so a checkpoint's
    manifest records it."""
    return field(default=default, metadata={"section": section, "when": when, "state": state})


@dataclass(frozen=True)
class LayoutSpec:
    """One layout: ``[parallel]`` degrees and schedule, gradient accumulation, ``[geo]`` placement and
    sync, the microbatch size."""

    dp_replicate: int = _key("parallel", 1, state=True)
    """Replicas (DDP) inside one datacenter; see :attr:`replicas` for all of them."""
    dp_shard: int = _key("parallel", 1, state=True)
    """Sharded data-parallel degree (ZeRO / FSDP)."""
    zero_stage: int = _key("parallel", 1, when=lambda s: s.shard_degree > 1, state=True)
    """What dp_shard shards: 1 optimizer state, 2 + gradients, 3 + parameters."""
    tp: int = _key("parallel", 1, state=True)
    sequence_parallel: bool = _key("parallel", False, when=lambda s: s.tp > 1, state=True)
    cp: int = _key("parallel", 1, state=True)
    cp_impl: CpImpl = _key("parallel", "ring", when=lambda s: s.cp > 1, state=True)
    ep: int = _key("parallel", 1, state=True)
    """Expert-parallel degree: folds over dp_shard x cp, each of its ranks holding n_experts / ep experts
    of every MoE layer (1: every rank holds all of them; a dense model ignores it)."""
    pp: int = _key("parallel", 1, state=True)
    pp_schedule: PpSchedule = _key("parallel", "1f1b", when=lambda s: s.pp > 1, state=True)
    pp_virtual_stages: int = _key("parallel", 1, state=True)
    microbatches: int = _key("parallel", 1, when=lambda s: s.pp > 1, state=True)
    """A pipeline's microbatches per step (``parallel.microbatches``); 1 without a pipeline."""
    grad_accum: int = _key("train", 1)
    """Forward/backward passes accumulated per optimizer step (``train.grad_accum``), each of
    ``microbatches`` microbatches under a pipeline."""
    activation_checkpoint: ActivationCheckpoint = _key("parallel", "none")
    datacenters: int = _key("geo", 1, state=True)
    """Datacenters the layout spans."""
    dc_axis: DcAxis = _key("geo", "none", when=lambda s: s.datacenters > 1, state=True)
    """Which dimension the datacenter boundary cuts: data-parallel replicas or pipeline stages."""
    sync: SyncKind = _key("geo", "none", when=lambda s: s.dc_axis == "dp", state=True)
    """How data-parallel gradients cross datacenters (dc_axis == 'dp')."""
    inner_steps: int = _key("geo", 50, when=lambda s: s.sync in DILOCO_SYNCS)
    """diloco / streaming_diloco: inner steps between two syncs of the same parameters."""
    fragments: int = _key("geo", 4, when=lambda s: s.sync == "streaming_diloco")
    """streaming_diloco: fragments synchronised in turn, one every inner_steps / fragments steps."""
    overlap_steps: int = _key("geo", 1, when=lambda s: s.sync == "streaming_diloco")
    """streaming_diloco: inner steps a fragment's transfer overlaps before its result is applied."""
    wan_schedule: WanSchedule = _key("geo", "fair", when=lambda s: s.dc_axis == "pp")
    """dc_axis == 'pp': how the pipelines crossing one WAN link share it (fair: at once; time_shared: in turn)."""
    wan_streams: int = _key("geo", 1)
    pp_early_recv: bool = _key("geo", False, when=lambda s: s.dc_axis == "pp" and s.wan_schedule == "fair")
    """dc_axis == 'pp', fair sharing: receives from another datacenter posted a step ahead, so no
    message waits a round trip for its receiver's notice."""
    """TCP connections one cross-datacenter transfer is split over (each carries at most window / RTT)."""
    pp_compression: PpCompression = _key("geo", "none")
    """How activations and their gradients cross a pipeline boundary between datacenters (none: exact);
    boundaries inside a datacenter stay exact."""
    pp_compression_rank: int = _key("geo", 32, when=lambda s: s.pp_compression == "lowrank")
    """pp_compression lowrank: the rank r of the projection each boundary message is sent in."""
    outer_dtype: OuterDtype = _key("geo", "auto")
    """diloco / streaming_diloco: the outer gradients' dtype on the WAN (auto: fp32 for diloco, int4 for
    streaming_diloco; topk2: SparseLoCo's top-k of each chunk at 2 bits)."""
    outer_density: float = _key("geo", 0.02, when=lambda s: s.outer_dtype == "topk2")
    """outer_dtype topk2: the fraction of each chunk's entries sent."""
    micro_batch: int = _key(None, 1)
    """Derived, no config key: sequences per microbatch (train.batch_size / (dp x microbatches x grad_accum))."""

    def __post_init__(self) -> None:
        if self.pp == 1 and self.microbatches != 1:
            raise ConfigError(
                "microbatches",
                self.microbatches,
                "counts a pipeline's microbatches and pp = 1: gradient accumulation is grad_accum",
            )

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
            self.dp_shard, self.cp, self.tp, self.pp, self.replicas, self.zero_stage, self.sync != "none", self.ep
        )

    @property
    def grad_sync_degree(self) -> int:
        """Ranks holding replicas of the same parameters: dp x cp."""
        return self.dp * self.cp

    @property
    def microbatches_per_step(self) -> int:
        """Microbatches one replica computes per step: the pipeline's times the accumulated passes.

        What the cost model counts (in flight, gathers, accumulation); it models a pipeline's
        microbatches or gradient accumulation, not both at once."""
        return self.microbatches * self.grad_accum

    @property
    def global_batch(self) -> int:
        """Sequences per step: ``train.batch_size``."""
        return self.dp * self.micro_batch * self.microbatches_per_step

    def dims(self) -> ParallelDims:
        """The degrees as the runtime's :class:`ParallelDims` (build its mesh with ``build_mesh``)."""
        dc = self.datacenters if self.dc_axis == "dp" else 1
        return ParallelDims(self.dp_replicate, self.dp_shard, self.cp, self.tp, self.pp, self.world, dc)

    # --- the fields and their config keys ------------------------------------------------------

    @classmethod
    def config_key(cls, name: str) -> str | None:
        """``section.key`` of a field (``parallel.tp``, ``train.grad_accum``); None for a derived
        field or a name that is not a field."""
        section = _FIELDS[name].metadata["section"] if name in _FIELDS else None
        return None if section is None else f"{section}.{name}"

    def applies(self, name: str) -> bool:
        """Whether a field means anything in this layout (``zero_stage`` without sharding does not)."""
        when = _FIELDS[name].metadata["when"]
        return when is None or bool(when(self))

    @classmethod
    def from_config(cls, cfg: LayoutConfig) -> LayoutSpec:
        """The layout a resolved ``JobConfig`` runs (data-parallel degrees of -1 must be filled first)."""
        p, g, t = cfg.parallel, cfg.geo, cfg.train
        if p.dp_replicate < 1 or p.dp_shard < 1:
            raise ValueError("fill the data-parallel degrees (-1) before taking the layout")
        values = {
            f.name: getattr(getattr(cfg, f.metadata["section"]), f.name) for f in fields(cls) if f.metadata["section"]
        }
        values["dc_axis"] = g.dc_axis if g.datacenters > 1 else "none"
        values["microbatches"] = p.microbatches if p.pp > 1 else 1
        spec = cls(**values)
        return replace(spec, micro_batch=max(1, t.batch_size // max(1, spec.dp * spec.microbatches_per_step)))

    def config_overrides(self, batch: bool = True) -> dict[str, object]:
        """``section.key -> value`` for every config key the layout sets (``parallel.nproc`` included);
        ``batch``: also ``train.batch_size`` (dp x micro_batch x microbatches x grad_accum)."""
        out: dict[str, object] = {"parallel.nproc": self.world}
        for f in fields(self):
            key = self.config_key(f.name)
            if key is not None:
                out[key] = getattr(self, f.name)
        out["geo.dc_axis"] = "dp" if self.dc_axis == "none" else self.dc_axis
        if batch:
            out["train.batch_size"] = self.global_batch
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
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise ValueError(f"not a layout field: {', '.join(unknown)} (fields: {', '.join(sorted(_FIELDS))})")
        return cls(**data)

    def with_(self, **changes: Any) -> LayoutSpec:
        return replace(self, **changes)

    # --- printed forms -------------------------------------------------------------------------

    def describe(self) -> str:
        """The layout as its config keys, e.g. ``dp_shard=2,zero_stage=3,tp=2,sequence_parallel=true``:
        each field that applies (:meth:`applies`) and either belongs to a mechanism in use or
        differs from its default; ``single`` for one process with nothing else set."""
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata["section"] is None or not self.applies(f.name):
                continue
            if f.metadata["when"] is not None or value != f.default:
                parts.append(f"{f.name}={str(value).lower() if isinstance(value, bool) else value}")
        return ",".join(parts) or "single"

    def manifest(self, world_size: int) -> dict[str, object]:
        """The ``layout`` a checkpoint manifest records (``isthmus.json``): the fields that decide
        what each rank holds, in the config's words, its size and :meth:`describe`. A run resumed
        under an equal one also restores each rank's RNG state."""
        keyed = self.config_overrides(batch=False)
        state = {f.name: keyed[f"{f.metadata['section']}.{f.name}"] for f in fields(self) if f.metadata["state"]}
        return {"summary": self.describe(), "world_size": world_size, **state}

    def label(self) -> str:
        """A compact one-line description, e.g. ``tp8 sp pp12/dc zb v2 dp32 z2 mb1x48 ac-full``."""
        parts = [f"tp{self.tp}" + (" sp" if self.sequence_parallel else "")]
        if self.cp > 1:
            parts.append(f"cp{self.cp}{'u' if self.cp_impl == 'ulysses' else ''}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
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
                + _compression_token(self)
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
            if self.sync in DILOCO_SYNCS and self.outer_dtype != "auto":
                dp += f" out-{self.outer_dtype}"
        parts.append(dp)
        parts.append(f"mb{self.micro_batch}x{self.microbatches_per_step}")
        if self.activation_checkpoint != "none":
            parts.append(f"ac-{self.activation_checkpoint}")
        return " ".join(parts)


_FIELDS: dict[str, Field[Any]] = {f.name: f for f in fields(LayoutSpec)}


def _compression_token(spec: LayoutSpec) -> str:
    """The label's word for compressed boundaries across datacenters (`` pc-int8``), or nothing."""
    if spec.pp_compression == "none" or spec.dc_axis != "pp":
        return ""
    rank = spec.pp_compression_rank if spec.pp_compression == "lowrank" else ""
    return f" pc-{spec.pp_compression}{rank}"


@dataclass(frozen=True)
class LabelPart:
    """One token :meth:`LayoutSpec.label` can print, its digits written N (:func:`label_parts`)."""

    token: str
    short: str
    """A few words, for the line under `isthmus plan`'s table."""
    means: str
    keys: str
    """The config keys it shows."""


LABEL_LEGEND: tuple[LabelPart, ...] = (
    LabelPart("tpN", "tensor parallel", "tensor parallelism over N ranks (tp1: none)", "parallel.tp"),
    LabelPart(
        "sp", "sequence parallel", "sequence parallelism inside the tensor-parallel group", "parallel.sequence_parallel"
    ),
    LabelPart("cpN", "context parallel", "context parallelism over N ranks, ring attention", "parallel.cp"),
    LabelPart("cpNu", "Ulysses cp", "context parallelism over N ranks by Ulysses all-to-all", "parallel.cp_impl"),
    LabelPart(
        "epN", "expert parallel", "expert parallelism: each rank holds 1/N of every MoE layer's experts", "parallel.ep"
    ),
    LabelPart("ppN", "pipeline stages", "N pipeline stages", "parallel.pp"),
    LabelPart(
        "/dc",
        "crosses datacenters",
        "after ppN: the datacenters hold consecutive stages, only activations cross the WAN; after dpN: the "
        "replicas span the datacenters and synchronise over the WAN by the sync that follows",
        "geo.dc_axis",
    ),
    LabelPart("gpipe", "GPipe", "pipeline schedule: all forwards, then all backwards", "parallel.pp_schedule"),
    LabelPart("1f1b", "1F1B", "pipeline schedule: one forward, one backward", "parallel.pp_schedule"),
    LabelPart("i1f1b", "interleaved 1F1B", "interleaved 1F1B, several stages per rank", "parallel.pp_schedule"),
    LabelPart("zb", "zero bubble", "zero-bubble schedule (ZB-V with vN 2)", "parallel.pp_schedule"),
    LabelPart("vN", "stages per rank", "N virtual pipeline stages per rank", "parallel.pp_virtual_stages"),
    LabelPart("ts", "time-shared WAN", "the pipelines crossing one WAN link take it in turn", "geo.wan_schedule"),
    LabelPart(
        "pc-int8",
        "int8 boundaries",
        "activations and their gradients cross the datacenters' stage boundaries in per-token int8",
        "geo.pp_compression",
    ),
    LabelPart(
        "pc-int4",
        "int4 boundaries",
        "activations and their gradients cross the datacenters' stage boundaries in per-token int4",
        "geo.pp_compression",
    ),
    LabelPart(
        "pc-lowrankN",
        "low-rank boundaries",
        "activations and their gradients cross the datacenters' stage boundaries projected to rank N",
        "geo.pp_compression, geo.pp_compression_rank",
    ),
    LabelPart(
        "dpN", "data parallel", "data parallelism of degree N over the whole layout, every datacenter included", ""
    ),
    LabelPart(
        "(rN sN)",
        "replicas x shards",
        "N replicas of N shards each; shown where replication and sharding meet",
        "parallel.dp_replicate (x datacenters), parallel.dp_shard",
    ),
    LabelPart(
        "zN",
        "ZeRO stage",
        "what the shards shard: 1 optimizer state, 2 + gradients, 3 + parameters",
        "parallel.zero_stage",
    ),
    LabelPart("flat", "flat WAN ring", "one flat all-reduce ring over every replica", "geo.sync"),
    LabelPart("hierarchical", "hierarchical", "reduce inside each datacenter, then across the WAN", "geo.sync"),
    LabelPart("compressed", "compressed", "gradient shards compressed over the WAN", "geo.sync"),
    LabelPart("none", "no WAN sync", "replicas across datacenters that never synchronise", "geo.sync"),
    LabelPart("diloco", "DiLoCo", "DiLoCo: outer steps every HN inner steps", "geo.sync"),
    LabelPart("sdiloco", "Streaming DiLoCo", "Streaming DiLoCo: fragments synchronised in turn", "geo.sync"),
    LabelPart(
        "HN", "inner steps", "N inner steps between two syncs of the same parameters (not a GPU)", "geo.inner_steps"
    ),
    LabelPart("FN", "fragments", "Streaming DiLoCo's N fragments, synchronised in turn", "geo.fragments"),
    LabelPart(
        "tN", "overlap steps", "steps a fragment's transfer overlaps before it is applied (tau)", "geo.overlap_steps"
    ),
    LabelPart("out-fp32", "fp32 outer gradients", "DiLoCo's outer gradients cross the WAN in fp32", "geo.outer_dtype"),
    LabelPart("out-bf16", "bf16 outer gradients", "DiLoCo's outer gradients cross the WAN in bf16", "geo.outer_dtype"),
    LabelPart(
        "out-int8",
        "int8 outer gradients",
        "DiLoCo's outer gradients cross the WAN in int8 with per-block scales",
        "geo.outer_dtype",
    ),
    LabelPart(
        "out-int4",
        "int4 outer gradients",
        "DiLoCo's outer gradients cross the WAN in int4 with per-block scales",
        "geo.outer_dtype",
    ),
    LabelPart(
        "out-topk2",
        "sparse outer gradients",
        "DiLoCo's outer gradients cross the WAN as the top outer_density of each chunk at 2 bits (SparseLoCo)",
        "geo.outer_dtype, geo.outer_density",
    ),
    LabelPart(
        "mbNxN",
        "microbatch x count",
        "microbatches of N sequences, N of them per step per replica (a pipeline's microbatches, or "
        "gradient accumulation without one)",
        "micro_batch (derived), parallel.microbatches or train.grad_accum",
    ),
    LabelPart(
        "ac-full",
        "full recompute",
        "every block's activations recomputed in the backward",
        "parallel.activation_checkpoint",
    ),
    LabelPart(
        "ac-selective",
        "selective recompute",
        "attention's core recomputed in the backward",
        "parallel.activation_checkpoint",
    ),
)
"""What every token of :meth:`LayoutSpec.label` means (`isthmus plan --legend`, docs/planning.md); a
test checks that each token a label can print is here."""

_WORDS = {"1f1b", "i1f1b", "pc-int8", "pc-int4", "out-fp32", "out-bf16", "out-int8", "out-int4", "out-topk2"}
"""Tokens whose digits are part of the word."""


def label_parts(label: str) -> list[str]:
    """The tokens of a :meth:`LayoutSpec.label`, digits written N (``dp512(r64 s8) z3/dc`` ->
    ``dpN``, ``(rN sN)``, ``zN``, ``/dc``), as :data:`LABEL_LEGEND` names them."""
    tokens = re.findall(r"\(r\d+ s\d+\)|/dc|[^\s/()]+", label)
    return [t if t in _WORDS else re.sub(r"\d+", "N", t) for t in tokens]


def legend_for(labels: list[str]) -> list[LabelPart]:
    """The legend entries the tokens of ``labels`` need, in the legend's order."""
    used = {t for label in labels for t in label_parts(label)}
    return [part for part in LABEL_LEGEND if part.token in used]


def _keys(section: str | None) -> tuple[str, ...]:
    return tuple(name for name, f in _FIELDS.items() if f.metadata["section"] == section)


PARALLEL_KEYS = _keys("parallel")
"""The ``[parallel]`` keys a layout sets (besides ``nproc``, its world size)."""
GEO_KEYS = _keys("geo")
"""The ``[geo]`` keys a layout sets."""
DERIVED = _keys(None)
"""Fields with no config key (see the module docstring)."""
