"""The words layout keys take, defined once: pipeline schedules, context-parallel kinds, recomputation
modes, cross-datacenter sync kinds and axes (a ``Literal`` for the types, a tuple for the checks).

``isthmus.config``, the planner and the runtime import them from here.
"""

from __future__ import annotations

from typing import Literal

PpSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]
PP_SCHEDULES: tuple[PpSchedule, ...] = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
CpImpl = Literal["ring", "ulysses"]
CP_IMPLS: tuple[CpImpl, ...] = ("ring", "ulysses")
ActivationCheckpoint = Literal["none", "full", "selective"]
ACTIVATION_CHECKPOINTS: tuple[ActivationCheckpoint, ...] = ("none", "full", "selective")
SyncKind = Literal["none", "flat", "hierarchical", "compressed", "diloco", "streaming_diloco"]
SYNC_KINDS: tuple[SyncKind, ...] = ("none", "flat", "hierarchical", "compressed", "diloco", "streaming_diloco")
GEO_SYNCS: tuple[SyncKind, ...] = SYNC_KINDS[1:]
"""The sync kinds that cross datacenters (all but none)."""
DILOCO_SYNCS: tuple[SyncKind, ...] = ("diloco", "streaming_diloco")
DcAxis = Literal["none", "dp", "pp"]
DC_AXES: tuple[DcAxis, ...] = ("none", "dp", "pp")
"""What a datacenter boundary cuts; 'none' is one datacenter (the config's geo.dc_axis is dp or pp)."""
WanSchedule = Literal["fair", "time_shared"]
WAN_SCHEDULES: tuple[WanSchedule, ...] = ("fair", "time_shared")
"""How the pipelines that cross one WAN link at a stage boundary share it: all at once at a fair share
of its bandwidth (what the runtime's sends do), or in turn, each transfer with the whole link, the
pipelines' starts staggered by one transfer slot (Atlas, arXiv 2411.14458)."""
PpCompression = Literal["none", "int8", "int4", "lowrank"]
PP_COMPRESSIONS: tuple[PpCompression, ...] = ("none", "int8", "int4", "lowrank")
"""How activations and their gradients cross a pipeline boundary between datacenters: exact, per-token
int8 or int4, or a rank-r projection (``isthmus.parallel.boundary_codec``)."""
OuterDtype = Literal["auto", "fp32", "bf16", "int8", "int4", "topk2"]
OUTER_DTYPES: tuple[OuterDtype, ...] = ("auto", "fp32", "bf16", "int8", "int4", "topk2")
"""What DiLoCo's outer gradients cross the WAN as; auto: fp32 for diloco, int4 for streaming_diloco."""
