"""Atlas-style placement and time-shared WAN slots (arXiv 2411.14458) in the planner and simulator.

Whole pipeline stages per datacenter with all their data-parallel replicas, stage counts by
datacenter size, a subset of the datacenters when a far or small one would slow a step; and the
pipelines crossing one WAN link in time slots instead of sharing it, in the cost model's formula
and the simulated link alike. Pure Python, fast.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from isthmus.cli import plan as plan_cli
from isthmus.cli.common import ArgumentParser
from isthmus.config import JobConfig, set_value, validate
from isthmus.errors import ConfigError
from isthmus.layout.spec import LayoutSpec
from isthmus.models.flavors import get_flavor
from isthmus.planner.explain import explain
from isthmus.planner.geo import pipeline_transfer
from isthmus.planner.placement import place, runnable, stage_counts
from isthmus.planner.search import SearchSpace, search
from isthmus.planner.topology import Link, Topology, load_topology
from isthmus.planner.workload import RUNTIMES, Workload
from isthmus.sim.engine import Engine, SlotLink
from isthmus.sim.run import simulate

ISTHMUS = RUNTIMES["isthmus"]


ATLAS_3DC = Path(__file__).resolve().parents[2] / "examples" / "atlas-3dc.toml"


def _three_dcs() -> Topology:
    """A big and a mid-sized datacenter 10 ms apart, and a small one 80 ms away on thin links
    (listed first, so only the placement rule leaves it out); docs/placement.md plans on it too."""
    return load_topology(str(ATLAS_3DC))


@pytest.fixture(scope="module")
def searched() -> tuple[Topology, object]:
    topo = _three_dcs()
    return topo, search(get_flavor("llama3-70b"), topo, SearchSpace(batch_size=128, seq_len=2048), ISTHMUS, top=5)


def _as_chosen(res: object) -> object:
    """The result as if the fastest what-if were chosen (what `--geo.datacenters 2` would plan)."""
    return replace(res, ranked=res.what_ifs, what_ifs=[])  # type: ignore[attr-defined, type-var]


def test_the_search_leaves_the_small_far_datacenter_out_and_says_why(searched: tuple[Topology, object]) -> None:
    topo, res = searched
    # The fastest layout is a what-if (the runtime splits ranks evenly over every datacenter): it is
    # listed apart, and the chosen one is the best the runtime runs.
    chosen, best = res.best, res.what_ifs[0]  # type: ignore[attr-defined]
    assert runnable(topo, chosen.layout) is None and best.effective_tokens_per_s > chosen.effective_tokens_per_s
    used = [topo.datacenters[i].name for i in place(topo, best.layout).dcs]
    assert best.layout.dc_axis == "pp" and sorted(used) == ["big", "mid"]
    with_far = res.alternatives["datacenters=3"]  # type: ignore[attr-defined]
    assert with_far.step_time_s > 1.3 * best.step_time_s
    text = explain(res, topo)  # type: ignore[arg-type]
    assert f"A planner-only what-if would be faster: {best.layout.label()}" in text
    assert "uses 2 of the 3 datacenters" in text
    text = explain(_as_chosen(res), topo)  # type: ignore[arg-type]
    assert "It uses big and mid (2 of 3 datacenters)." in text
    assert (
        f"It leaves out far: with far the best layout ({with_far.layout.label()}) takes "
        f"{with_far.step_time_s:.3g} s per step, against {best.step_time_s:.3g} s without" in text
    )
    assert "This is a planner-only what-if" in text and "The best layout the runtime runs as planned is" in text


def test_stage_counts_follow_datacenter_sizes(searched: tuple[Topology, object]) -> None:
    topo, res = searched
    best = res.what_ifs[0]  # type: ignore[attr-defined]
    pl = place(topo, best.layout)
    width = best.layout.dp * best.layout.cp * best.layout.tp
    counts = [topo.datacenters[i].devices // width for i in pl.dcs]
    assert list(pl.stages_per_dc) == counts and counts[0] == 2 * counts[1]  # 32 and 16 devices: every one used
    assert f"spread {counts[0]} in big, {counts[1]} in mid" in explain(_as_chosen(res), topo)  # type: ignore[arg-type]
    # Only stage boundaries cross the WAN: one boundary, between the two datacenters.
    assert sum(1 for _, _, wan in pl.boundary_links if wan) == 1
    # Fewer stages than devices allow: by compute, the largest first on ties; alike datacenters alike.
    big, mid = 1, 2
    assert stage_counts(topo, [big, mid], 3, 4) == [2, 1]
    assert stage_counts(topo, [big, mid], 5, 8) == [3, 2]
    assert stage_counts(topo, [big, mid], 6, 8) == [4, 2]  # every device: 32 + 16
    two = load_topology("emulated-2dc")
    assert stage_counts(two, [0, 1], 4, 1) == [2, 2]
    with pytest.raises(ConfigError, match="parallel.pp"):
        stage_counts(topo, [big, mid], 7, 8)


def test_the_time_shared_formula() -> None:
    link = Link(bandwidth=1e9, latency=0.04)
    fair = pipeline_transfer(1e7, link, 4, "fair")
    slots = pipeline_transfer(1e7, link, 4, "time_shared")
    # Fair: all four at once, each at a quarter of the link. Slots: each whole, one after another.
    assert fair.seconds == pytest.approx(0.04 + 4 * 0.01) and fair.stagger == 0.0
    assert slots.seconds == pytest.approx(0.04 + 0.01) and slots.stagger == pytest.approx(3 * 0.01)
    assert slots.occupancy == fair.occupancy == pytest.approx(4 * 0.01)


def test_a_slot_link_serves_in_turn_and_holds_the_others_slots() -> None:
    eng = Engine(record=False)
    link = SlotLink(eng, "wan", "wan")
    done: list[float] = []
    link.add(1.0, 1.0, 0.0, lambda: done.append(eng.now), hold=3.0)
    link.add(1.0, 1.0, 0.0, lambda: done.append(eng.now), hold=3.0)
    eng.run()
    assert done == [1.0, 5.0] and link.busy == 8.0


def _two_dcs(latency_us: float) -> Topology:
    topo = load_topology("geo-3dc-h100")
    dcs = tuple(replace(d, nodes=2) for d in topo.datacenters[:2])
    pair = frozenset(d.name for d in dcs)
    return replace(topo, datacenters=dcs, wan={pair: topo.wan[pair]}).with_wan(bandwidth_gb_s=5, latency_us=latency_us)


@pytest.mark.parametrize("latency_us", [10000, 40000])
def test_time_shared_slots_beat_fair_sharing_and_the_simulator_agrees(latency_us: float) -> None:
    topo = _two_dcs(latency_us)
    work = Workload(get_flavor("llama3-8b"), 32, 4096, "bf16")
    base = LayoutSpec(
        tp=8, sequence_parallel=True, pp=2, dp_replicate=2, micro_batch=1, microbatches=16, datacenters=2, dc_axis="pp"
    )
    fair = simulate(work, topo, base, ISTHMUS)
    slots = simulate(work, topo, base.with_(wan_schedule="time_shared"), ISTHMUS)
    for res in (fair, slots):
        assert res.step_time_s == pytest.approx(res.planner.step_time_s, rel=0.10)
        assert res.wan_bytes_per_step == pytest.approx(res.planner.wan_bytes_per_step, rel=1e-6)
    # 16 transfers per boundary (2 replicas x 8 tensor-parallel ranks) on one 5 GB/s link.
    assert slots.step_time_s < 0.9 * fair.step_time_s
    assert slots.planner.step_time_s < 0.9 * fair.planner.step_time_s
    assert runnable(topo, base) is None and runnable(topo, slots.layout) is None  # the runtime runs both


def test_wan_schedule_round_trips_config_plan_and_layout(capsys: pytest.CaptureFixture[str]) -> None:
    parser = ArgumentParser(prog="isthmus")
    sub = parser.add_subparsers(dest="command", parser_class=ArgumentParser)
    plan_cli.add_parser(sub)
    argv = ["plan", "--model.flavor", "tiny", "--topology", "emulated-2dc", "--train.batch_size", "8"]
    argv += ["--train.seq_len", "32", "--top", "3", "--json", "--geo.dc_axis", "pp", "--parallel.pp", "2"]
    argv += ["--parallel.tp", "2", "--geo.wan_streams", "3", "--geo.wan_schedule", "time_shared"]
    assert plan_cli.run(parser.parse_args(argv)) == 0
    best = json.loads(capsys.readouterr().out)["layouts"][0]
    assert best["geo"]["wan_schedule"] == "time_shared" and best["layout"]["wan_schedule"] == "time_shared"
    assert best["geo"]["wan_streams"] == 3 and best["layout"]["wan_streams"] == 3
    assert best["what_if"] is None  # the runtime runs time slots as planned
    cfg = JobConfig()
    for section in ("parallel", "geo", "train"):
        for key, value in best[section].items():
            set_value(cfg, f"{section}.{key}", value, from_cli=False)
    validate(cfg)
    assert LayoutSpec.from_config(cfg) == LayoutSpec.from_dict(best["layout"])
    with pytest.raises(ConfigError, match="--geo.wan_schedule = 'slotted'"):
        plan_cli.search_space(parser.parse_args([*argv[:-1], "slotted"]))


def test_training_refuses_a_time_shared_wan_without_a_pipeline_across_datacenters() -> None:
    from isthmus.launch.preflight import preflight

    cfg = JobConfig()
    set_value(cfg, "model.flavor", "tiny", from_cli=False)
    set_value(cfg, "geo.wan_schedule", "time_shared", from_cli=False)
    validate(cfg)
    with pytest.raises(ConfigError, match="geo.wan_schedule = 'time_shared'.*geo.dc_axis = pp") as err:
        preflight(cfg)
    assert "\n" not in str(err.value)


def test_a_tcp_window_caps_each_flow_and_streams_recover_the_link() -> None:
    link = Link(bandwidth=12.5e6, latency=0.04, window=64 * 1024)  # 100 Mbit/s, 80 ms RTT, 64 KiB
    assert link.rate(1) == pytest.approx(32 * 1024 / 0.08) and link.rate(100) == link.bandwidth  # half the buffer
    assert Link(12.5e6, 0.04).rate(1) == 12.5e6  # no window: the alpha-beta link, today's figures
    msg = 262144.0  # one `small` microbatch's activation (2 x 128 x 256 fp32)
    naive = pipeline_transfer(msg, link, 2, "fair", 1)
    striped = pipeline_transfer(msg, link, 2, "fair", 4)
    # Window-bound: one flow at 32 KiB per round trip, slow start from 10 segments; 4 flows each
    # carry a quarter and ramp up in fewer round trips.
    assert naive.seconds > 8 * 0.08 and striped.seconds < 0.6 * naive.seconds
    # In slots the turn costs a round trip (the receiver posts its receive on its turn).
    slots = pipeline_transfer(msg, link, 2, "time_shared", 4)
    assert slots.stagger == pytest.approx(slots.occupancy / 2) and slots.seconds > 2 * 0.04


def test_the_topology_carries_the_wan_window_to_planner_and_emulator(tmp_path: Path) -> None:
    from isthmus.cli.emulate import topology_window_kib

    preset = load_topology("emulated-2dc")
    assert topology_window_kib(preset) == 0  # no window: the kernel's autotuning
    text = (Path(__file__).resolve().parents[2] / "src/isthmus/topologies/emulated-2dc.toml").read_text()
    path = tmp_path / "windowed.toml"
    path.write_text(text.replace("latency_us = 0 ", "latency_us = 40000\nwindow_kib = 64 "))
    topo = load_topology(str(path))
    assert topology_window_kib(topo) == 64 and topo.wan_link("dc0", "dc1").window == 64 * 1024
    work = Workload(get_flavor("small"), 16, 128, "fp32")
    lay = LayoutSpec(pp=2, dp_replicate=2, microbatches=4, micro_batch=2, datacenters=2, dc_axis="pp")
    free = simulate(work, preset.with_wan(latency_us=40000), lay, ISTHMUS).step_time_s
    capped = simulate(work, topo, lay, ISTHMUS).step_time_s
    striped = simulate(work, topo, lay.with_(wan_streams=4), ISTHMUS).step_time_s
    assert capped > 1.5 * free and striped < capped
    path.write_text(text.replace("latency_us = 0 ", "window_kib = -1\nlatency_us = 0 "))
    with pytest.raises(ConfigError, match="window_kib"):
        load_topology(str(path))


def test_plan_json_lists_the_layouts_that_run_first(searched: tuple[Topology, object]) -> None:
    from isthmus.planner.explain import result_json

    topo, res = searched
    rows = result_json(res, topo, 3)["layouts"]  # type: ignore[arg-type]
    runs = [row["what_if"] is None for row in rows]
    assert runs[0] and runs == sorted(runs, reverse=True) and not runs[-1]  # the chosen one runs; what-ifs last
