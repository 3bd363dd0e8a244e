"""The planner: a cost model of parallel training and a search over layouts. Pure Python, no torch.

What the pieces answer (the simulator and calibration build on these):

- per-op compute time: ``compute.layer_ops / head_ops / embedding_ops`` (one ``Op`` per kernel
  with FLOPs, bytes and seconds), ``gemm_time``, ``gemm_fraction``, ``memory_time``,
  ``optimizer_time``;
- per-collective time on a group: ``placement.place(topology, layout)`` gives each group's
  ``comm.Span``; ``comm.all_reduce / reduce_scatter / all_gather / all_to_all / p2p`` time it;
  ``geo.cross_dc_all_reduce`` adds the cross-datacenter strategies;
- memory per device: ``memory.device_memory`` (or ``cost.rank_memory`` for a layout);
- the stage partition: ``cost.stage_costs`` (per pipeline rank: layers and per-microbatch
  forward / backward / weight-gradient seconds), ``pipeline.partition_layers``;
- a whole layout: ``cost.estimate``; every layout: ``search.search``; text: ``explain``.

(``search`` here is the module; ``from isthmus.planner.search import search`` is the function.)
"""

from isthmus.planner.comm import Span, all_gather, all_reduce, all_to_all, p2p, reduce_scatter
from isthmus.planner.compute import BlockShape, Op, gemm_fraction, gemm_time, layer_ops, memory_time
from isthmus.planner.cost import Estimate, StageCost, estimate, rank_memory, stage_costs
from isthmus.planner.memory import MemoryBreakdown, device_memory
from isthmus.planner.pipeline import in_flight, partition_layers, pipeline_time
from isthmus.planner.placement import Placement, place
from isthmus.planner.search import SearchResult, SearchSpace
from isthmus.planner.workload import RUNTIMES, Runtime, Workload

__all__ = [
    "RUNTIMES",
    "Runtime",
    "Workload",
    "BlockShape",
    "Op",
    "gemm_fraction",
    "gemm_time",
    "layer_ops",
    "memory_time",
    "Span",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "p2p",
    "reduce_scatter",
    "Placement",
    "place",
    "in_flight",
    "partition_layers",
    "pipeline_time",
    "MemoryBreakdown",
    "device_memory",
    "Estimate",
    "StageCost",
    "estimate",
    "rank_memory",
    "stage_costs",
    "SearchResult",
    "SearchSpace",
]
