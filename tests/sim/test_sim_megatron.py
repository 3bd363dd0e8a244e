"""Megatron-LM 2021 Table 1 through the simulator: every row's per-GPU TFLOP/s within 10%.

The cost model already meets this (tests/planner/test_planner_megatron.py); the simulator replays the same
per-op costs event by event, so it must too. Only one pipeline "column" is simulated: the
data-parallel replicas run identical programs, so one replica's pp stages stand for all of them
(each simulated device for its 8 tensor-parallel peers, which are symmetric as well), and the
gradient all-reduce over the replicas is timed on the link it crosses (InfiniBand here).
"""

from __future__ import annotations

import pytest

from isthmus.models.flavors import gpt3
from isthmus.planner.reference import MEGATRON_2021_TABLE1, SEQ_LEN, MegatronRow, megatron_layout
from isthmus.planner.topology import load_topology
from isthmus.planner.workload import RUNTIMES, Workload
from isthmus.sim import simulate

TOLERANCE = 0.10


@pytest.mark.parametrize("row", MEGATRON_2021_TABLE1, ids=[f"{r.params_b}B" for r in MEGATRON_2021_TABLE1])
@pytest.mark.slow
def test_simulated_tflops_within_ten_percent(row: MegatronRow) -> None:
    lay = megatron_layout(row)
    work = Workload(gpt3(row.heads, row.hidden, row.layers), row.global_batch, SEQ_LEN, "fp16")
    res = simulate(work, load_topology("selene-a100").subset(row.gpus), lay, RUNTIMES["megatron-2021"])
    assert res.devices_simulated == row.pp and lay.world == row.gpus
    err = res.tflops_per_device / row.tflops_per_gpu - 1
    assert abs(err) <= TOLERANCE, f"{row.params_b}B: simulated {res.tflops_per_device:.1f} vs {row.tflops_per_gpu}"
    # And with the cost model, to within the agreement of tests/sim/test_sim.py.
    assert res.tflops_per_device == pytest.approx(res.planner.tflops_per_device, rel=0.03)
