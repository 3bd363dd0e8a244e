"""ZeRO-1 (Megatron's distributed optimizer) next to tp and pp: admitted, searched and priced."""

from __future__ import annotations

import pytest

from isthmus.layout import rules
from isthmus.layout.spec import LayoutSpec
from isthmus.models.flavors import FLAVORS
from isthmus.planner import comm
from isthmus.planner.geo import dp_sync
from isthmus.planner.memory import model_state_bytes
from isthmus.planner.placement import place
from isthmus.planner.topology import load_topology
from isthmus.planner.workload import RUNTIMES, Workload
from isthmus.sim import simulate


def test_zero1_with_tp_pp_cp_and_replicas_is_admitted_and_searched() -> None:
    for tp, pp, cp, replicas in ((2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)):
        assert rules.zero_stage(1, 2, tp, pp, cp, replicas) is None
        assert rules.zero_stages(2, tp, pp, cp, replicas) == (1, 2, 3)
        assert rules.data_parallel_kind(2, cp, tp, pp, replicas, 1) == "fsdp"
        assert rules.sharded_optimizer("fsdp", 1, 2, cp)
    assert rules.data_parallel_kind(2, 1, 1, 1, 1, 1) == "zero1"  # dp_shard alone: DDP + ZeroRedundancyOptimizer
    assert "geo.sync" in str(rules.zero_stage(1, 2, 2, 1, 1, 2, geo_sync=True))


def test_zero1_with_tp_and_pp_costs_one_all_reduce_and_no_microbatch_gathers() -> None:
    topo = load_topology("eos-h100").subset(64)
    runtime = RUNTIMES["current"] if "current" in RUNTIMES else RUNTIMES["isthmus"]
    lay = LayoutSpec(dp_shard=4, tp=8, sequence_parallel=True, pp=2, microbatches=8, micro_batch=1, zero_stage=1)
    site = place(topo, lay).sites[0]
    sync = dp_sync(1e9, site, lay, runtime)
    # Megatron's reduce-scatter of the gradients and all-gather of the weights, once per step: with
    # bytes equal, one all-reduce's worth.
    assert sync.per_microbatch == 0.0
    assert sync.grad == pytest.approx(comm.reduce_scatter(1e9 * runtime.grad_bytes, site.shard))
    assert sync.params == pytest.approx(comm.all_gather(1e9 * runtime.weight_bytes, site.shard))
    same = comm.reduce_scatter(1e9, site.shard) + comm.all_gather(1e9, site.shard)
    assert same == pytest.approx(comm.all_reduce(1e9, site.shard), rel=0.05)
    # weights and gradients whole, the optimizer state over dp_shard (bf16's gathered copy beside the weights)
    w, g, o = model_state_bytes(1e9, 1, 4, runtime, pp=2, gathered_bytes=2)
    assert (w, g, o) == (1e9 * (runtime.weight_bytes + 2), 1e9 * runtime.grad_bytes, 1e9 * runtime.optimizer_bytes / 4)
    work = Workload(FLAVORS["llama3-8b"], 64, 8192, "bf16")
    res = simulate(work, topo, lay, runtime)
    assert res.step_time_s == pytest.approx(res.planner.step_time_s, rel=0.05)
