"""`GeoRun` / `DatacenterJob`: what the trainer asks of a run across datacenters, without processes.

The multi-process tests (test_geo.py, test_geo_failure.py, test_parallel_equivalence.py) check the
same answers end to end; these pin each one down on its own.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from isthmus.config import GeoConfig, MetricsConfig
from isthmus.errors import IsthmusError
from isthmus.geo.accounting import new_counter
from isthmus.geo.fault import DC_INDEX_ENV, LIGHTHOUSE_ENV, FaultTolerantJob
from isthmus.geo.run import DatacenterJob, GeoRun, build_geo_run, geo_grids


def _ft_cfg() -> GeoConfig:
    return GeoConfig(datacenters=2, sync="diloco", fault_tolerant=True, outer_dtype="fp32")


def test_the_plain_run_is_the_whole_run() -> None:
    run = build_geo_run(GeoConfig())
    assert type(run) is GeoRun and run.whole_run
    assert run.run_dir(Path("runs/x")) == Path("runs/x")
    assert run.layout_world(4) == 4
    assert run.dp_rank(3, rank=5, world=8) == 3
    assert run.tokens_per_step(1024) == 1024
    mcfg = MetricsConfig(jsonl="m.jsonl")
    assert run.metrics_config(mcfg) is mcfg
    assert run.join([]) == 0
    # Nothing crosses a datacenter: no per-step metrics, an empty summary.
    assert run.step_metrics(run.step_counters()) == {}
    run.finish([])
    assert run.bytes_by_tier == {}


def test_replica_keys_under_diloco() -> None:
    run = GeoRun(GeoConfig(datacenters=2, sync="diloco"))
    assert [run.replica_key(2, rank, 4) for rank in range(4)] == ["", "", "dc1", "dc1"]
    assert run.replica_key(1, 3, 4) == ""
    assert GeoRun(GeoConfig(datacenters=2, sync="flat")).replica_key(2, 3, 4) == ""


def test_per_step_bytes_are_deltas_and_the_summary_is_the_total() -> None:
    run = GeoRun(GeoConfig(datacenters=2, sync="flat"))
    sent = new_counter()
    run.sync = SimpleNamespace(bytes_sent=sent, finish=lambda params: None)  # type: ignore[assignment]
    sent["wan"] += 10
    assert run.step_metrics(run.step_counters()) == {"intra_node_bytes": 0, "intra_dc_bytes": 0, "wan_bytes": 10}
    sent["wan"] += 5
    sent["intra_dc"] += 2
    assert run.step_metrics(run.step_counters()) == {"intra_node_bytes": 0, "intra_dc_bytes": 2, "wan_bytes": 5}
    run.finish([])
    assert run.bytes_by_tier == {"intra_node": 0, "intra_dc": 2, "wan": 15}


def test_as_a_step_hook_the_run_hands_the_step_to_its_strategy() -> None:
    run = GeoRun(GeoConfig(datacenters=2, sync="flat"))
    calls: list[tuple[str, int | None]] = []
    run.begin_step(1)
    run.reduce_gradients([])
    run.after_optimizer_step(1, [])  # no strategy built yet: nothing to hand over
    run.sync = SimpleNamespace(  # type: ignore[assignment]
        reduce_gradients=lambda params: calls.append(("reduce", None)),
        after_optimizer_step=lambda step, params: calls.append(("after", step)),
    )
    run.reduce_gradients([])
    run.after_optimizer_step(1, [])
    assert calls == [("reduce", None), ("after", 0)]  # the strategy counts steps from 0
    waited: list[str] = []
    with run.span("optimizer"):
        run.wait(None, "all-reduce loss", lambda work, name: waited.append(name))
    assert waited == ["all-reduce loss"] and run.end_step(1) == {}


def test_pipeline_across_datacenters_reports_wan_only() -> None:
    run = GeoRun(GeoConfig(datacenters=2, dc_axis="pp"))
    run.pipeline_wan = new_counter()
    run.pipeline_wan["wan"] = 7
    assert run.step_metrics(run.step_counters()) == {"wan_bytes": 7}
    run.pipeline_wan["wan"] = 9
    assert run.step_metrics(run.step_counters()) == {"wan_bytes": 2}
    run.finish([])
    assert run.bytes_by_tier == {"wan": 9}


def test_no_pipeline_counter_without_a_pipeline_across_datacenters() -> None:
    run = GeoRun(GeoConfig(datacenters=2, dc_axis="pp"))
    run.wire_pipeline(None, 2, None)
    assert run.pipeline_wan is None


def test_a_datacenter_job_answers_for_its_datacenter() -> None:
    job = DatacenterJob(_ft_cfg(), FaultTolerantJob(1, 2, "http://127.0.0.1:1", "127.0.0.1"))
    assert not job.whole_run
    assert job.run_dir(Path("runs/x")) == Path("runs/x/dc1")
    assert job.layout_world(3) == 6
    assert job.dp_rank(0, rank=2, world=3) == 5  # datacenter-major
    assert job.replica_key(2, 2, 3) == ""
    assert job.tokens_per_step(1024) == 512
    assert job.metrics_config(MetricsConfig(jsonl="out/m.jsonl")).jsonl == "out/m.dc1.jsonl"
    assert job.metrics_config(MetricsConfig()).jsonl == ""


def test_a_datacenter_job_reports_the_quorum_of_each_new_round() -> None:
    job = DatacenterJob(_ft_cfg(), FaultTolerantJob(0, 2, "http://127.0.0.1:1", "127.0.0.1"))
    history: list[SimpleNamespace] = [SimpleNamespace(participants=2)]  # the joining round
    sync = SimpleNamespace(bytes_sent=new_counter(), history=history, join=lambda params: 0)
    job.ft_sync = job.sync = sync  # type: ignore[assignment]
    assert job.join([]) == 0
    assert job.end_step(1) == {}  # no round in this step
    history.append(SimpleNamespace(participants=1))
    assert job.end_step(2) == {"dc_quorum": 1}
    assert job.end_step(3) == {}
    assert "dc_quorum" not in job.step_metrics(job.step_counters())  # the step's sums carry bytes only


def test_build_geo_run_reads_the_datacenter_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DC_INDEX_ENV, "1")
    monkeypatch.setenv(LIGHTHOUSE_ENV, "http://127.0.0.1:1")
    run = build_geo_run(_ft_cfg())
    assert isinstance(run, DatacenterJob) and run.job.dc_index == 1 and run.job.n_dc == 2
    monkeypatch.delenv(DC_INDEX_ENV)
    with pytest.raises(IsthmusError):
        build_geo_run(_ft_cfg())


def test_geo_grids_are_datacenter_major() -> None:
    # 2 datacenters x 2 pipeline stages x 2 replicas: per stage, grid[d][j] = rank of replica j in d.
    assert geo_grids(2, 2, 2, 1, 1, 1) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    # FSDP over 2 shards: the shards are separate parts, the replicas dp_replicate alone.
    assert geo_grids(2, 1, 1, 2, 1, 1) == [[[0], [2]], [[1], [3]]]
