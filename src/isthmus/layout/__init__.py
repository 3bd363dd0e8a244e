"""One layout, one vocabulary: the parallel layout of a run as the planner, simulator and runtime see it.

- :mod:`isthmus.layout.spec`: :class:`LayoutSpec`, whose field names are the config keys;
- :mod:`isthmus.layout.choices`: the words those keys take (schedules, context-parallel kinds,
  recomputation modes, sync kinds), defined once;
- :mod:`isthmus.layout.rules`: every layout rule, written once, returning a reason or None;
- :mod:`isthmus.layout.dims`: :class:`ParallelDims`, the degrees of a run and its device mesh.

Pure Python: nothing here imports torch (``ParallelDims.build_mesh`` imports it when called).
"""

from isthmus.layout.choices import (
    ACTIVATION_CHECKPOINTS,
    CP_IMPLS,
    DC_AXES,
    GEO_SYNCS,
    PP_SCHEDULES,
    SYNC_KINDS,
    ActivationCheckpoint,
    CpImpl,
    DcAxis,
    PpSchedule,
    SyncKind,
)
from isthmus.layout.spec import LayoutSpec

__all__ = [
    "ACTIVATION_CHECKPOINTS",
    "CP_IMPLS",
    "DC_AXES",
    "GEO_SYNCS",
    "PP_SCHEDULES",
    "SYNC_KINDS",
    "ActivationCheckpoint",
    "CpImpl",
    "DcAxis",
    "LayoutSpec",
    "PpSchedule",
    "SyncKind",
]
