"""The simulator: its engine, torch's schedules, agreement with the cost model, trace and timeline."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest

from isthmus.layout.spec import LayoutSpec
from isthmus.models.flavors import get_flavor
from isthmus.planner.pipeline import in_flight
from isthmus.planner.topology import load_topology
from isthmus.planner.workload import RUNTIMES, Workload
from isthmus.sim import simulate, write_png, write_trace
from isthmus.sim.engine import Device, Engine, Link, Phase, Transfer
from isthmus.sim.schedule import peak_in_flight, rank_actions, stage_ranks

ISTHMUS = RUNTIMES["isthmus"]
SMALL = Workload(get_flavor("small"), 16, 128, "fp32")


# --- engine ---------------------------------------------------------------------------------------


def _run_flows(weights: list[float], seconds: float = 1.0, min_stretch: float = 0.0) -> list[float]:
    eng = Engine()
    link = Link(eng, "l", "intra")
    ends: list[float] = []
    for w in weights:
        Transfer(
            eng, [Phase(link, 0.0, seconds, w, min_stretch)], "x", "dp", "t", "dp", on_done=lambda: ends.append(eng.now)
        ).start()
    eng.run()
    return ends


def test_processor_sharing_splits_a_link_between_flows() -> None:
    assert _run_flows([1.0]) == pytest.approx([1.0])
    assert _run_flows([1.0, 1.0]) == pytest.approx([2.0, 2.0])  # two full-link flows: each at half speed
    # Flows that each use half the link at nominal speed do not slow each other down...
    assert _run_flows([0.5, 0.5]) == pytest.approx([1.0, 1.0])
    # ...and one alone takes the whole link, twice as fast, unless its own floor stops it.
    assert _run_flows([0.5]) == pytest.approx([0.5])
    assert _run_flows([0.5], min_stretch=0.8) == pytest.approx([0.8])


def test_a_late_flow_shares_only_while_both_run() -> None:
    eng = Engine()
    link = Link(eng, "l", "intra")
    ends: dict[str, float] = {}
    a = Transfer(eng, [Phase(link, 0.0, 1.0)], "a", "dp", "t", "dp", on_done=lambda: ends.setdefault("a", eng.now))
    b = Transfer(eng, [Phase(link, 0.25, 0.5)], "b", "dp", "t", "dp", on_done=lambda: ends.setdefault("b", eng.now))
    a.start()
    b.start()  # 0.25 s of latency, then shares: a has 0.75 left at half speed while b runs
    eng.run()
    assert ends["b"] == pytest.approx(1.25) and ends["a"] == pytest.approx(1.5)


def test_device_runs_its_program_in_order_and_waits() -> None:
    eng = Engine()
    link = Link(eng, "l", "intra")
    xf = Transfer(eng, [Phase(link, 0.1, 0.4)], "send", "p2p", "device:0", "p2p")

    def sender():  # noqa: ANN202
        yield ("compute", 1.0, "F", "fwd", None)
        yield ("start", xf)
        yield ("compute", 1.0, "F", "fwd", None)

    def receiver():  # noqa: ANN202
        yield ("wait", xf.token)
        yield ("compute", 2.0, "F", "fwd", None)

    devs = [Device(eng, 0, sender()), Device(eng, 1, receiver())]
    for d in devs:
        d.start()
    eng.run()
    assert devs[0].finished == pytest.approx(2.0) and devs[1].finished == pytest.approx(3.5)
    assert devs[1].busy == pytest.approx(2.0)


# --- schedules ------------------------------------------------------------------------------------

CASES = [
    ("gpipe", 4, 1, 8),
    ("1f1b", 4, 1, 8),
    ("1f1b", 3, 1, 3),
    ("interleaved_1f1b", 4, 2, 8),
    ("interleaved_1f1b", 4, 3, 6),
    ("interleaved_1f1b", 2, 2, 3),
    ("zero_bubble", 4, 2, 8),
    ("zero_bubble", 2, 2, 2),
    ("zero_bubble", 4, 3, 8),
]


@pytest.mark.parametrize("schedule, pp, v, m", CASES)
def test_every_rank_runs_each_pass_of_its_stages_once(schedule: str, pp: int, v: int, m: int) -> None:
    owner = stage_ranks(schedule, pp, v)
    assert sorted(Counter(owner).values()) == [v] * pp
    for r in range(pp):
        acts = rank_actions(schedule, pp, v, m, r)
        mine = {s for s, o in enumerate(owner) if o == r}
        kinds = {"F", "I", "W"} if schedule == "zero_bubble" else {"F", "B"}
        assert Counter(acts) == Counter((k, s, mb) for k in kinds for s in mine for mb in range(m))
        done: set[tuple[str, int, int]] = set()
        for kind, s, mb in acts:  # on one rank: a backward after its forward, a weight pass after its backward
            assert kind == "F" or ("F", s, mb) in done
            assert kind != "W" or ("I", s, mb) in done
            done.add((kind, s, mb))


def test_zbv_puts_both_ends_on_rank_zero() -> None:
    assert stage_ranks("zero_bubble", 4, 2) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert stage_ranks("interleaved_1f1b", 2, 3) == [0, 1, 0, 1, 0, 1]


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4)])
def test_activations_in_flight_match_the_memory_model(schedule: str, v: int) -> None:
    pp, m = 4, 16
    for r in range(pp):
        peak = peak_in_flight(rank_actions(schedule, pp, v, m, r)) / v
        assert peak == pytest.approx(in_flight(schedule, pp, v, m, r), abs=1 / v)


# --- agreement with the cost model ------------------------------------------------------------------

# The simulator replays the cost model's per-op numbers, so where the cost model's closed forms
# hold the two agree; they differ by (a) the pipeline: the cost model's fill is (p - 1)/v of a
# stage, the simulator runs torch's action order (interleaved warm-up in rounds, uneven stages,
# sends that pace it); (b) data parallelism: the cost model hides one all-reduce behind a window
# of the backward, the simulator starts each block's bucket when its gradient is final, each
# paying its latency, the last ones exposed; (c) links: the simulator lets traffic of different
# kinds share a port, the cost model gives each collective its link. Measured spread: under 2.1%.
TOLERANCE = 0.03

AGREE = [
    ("small", "local", LayoutSpec(micro_batch=16), 16, 128),
    ("small", "local", LayoutSpec(dp_replicate=2, micro_batch=8), 16, 128),
    ("small", "local", LayoutSpec(tp=2, sequence_parallel=True, micro_batch=16), 16, 128),
    ("small", "local", LayoutSpec(pp=2, pp_schedule="1f1b", micro_batch=4, microbatches=4), 16, 128),
    (
        "small",
        "local",
        LayoutSpec(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2, micro_batch=4, microbatches=4),
        16,
        128,
    ),
    (
        "llama3-8b",
        "selene-a100",
        LayoutSpec(tp=8, sequence_parallel=True, dp_replicate=8, micro_batch=2, grad_accum=4),
        64,
        4096,
    ),
    (
        "llama3-8b",
        "selene-a100",
        LayoutSpec(tp=8, sequence_parallel=True, pp=2, dp_replicate=4, micro_batch=1, microbatches=16),
        64,
        4096,
    ),
    (
        "llama3-8b",
        "selene-a100",
        LayoutSpec(
            tp=8,
            sequence_parallel=True,
            pp=4,
            pp_schedule="interleaved_1f1b",
            pp_virtual_stages=2,
            dp_replicate=2,
            micro_batch=1,
            microbatches=32,
        ),
        64,
        4096,
    ),
    (
        "llama3-70b",
        "selene-a100",
        LayoutSpec(
            tp=8,
            sequence_parallel=True,
            pp=8,
            dp_shard=8,
            zero_stage=2,
            micro_batch=1,
            microbatches=64,
            activation_checkpoint="selective",
        ),
        512,
        4096,
    ),
    (
        "llama3-70b",
        "selene-a100",
        LayoutSpec(
            tp=8,
            sequence_parallel=True,
            pp=8,
            pp_schedule="interleaved_1f1b",
            pp_virtual_stages=5,
            dp_shard=8,
            zero_stage=2,
            micro_batch=1,
            microbatches=64,
            activation_checkpoint="full",
        ),
        512,
        4096,
    ),
]


@pytest.mark.parametrize("flavor, topology, layout, batch, seq", AGREE, ids=[f"{a[0]}:{a[2].label()}" for a in AGREE])
def test_simulator_agrees_with_the_cost_model(
    flavor: str, topology: str, layout: LayoutSpec, batch: int, seq: int
) -> None:
    topo = load_topology(topology).subset(layout.world)
    work = Workload(get_flavor(flavor), batch, seq, topo.datacenters[0].kind.default_dtype)
    res = simulate(work, topo, layout, ISTHMUS)
    est = res.planner
    assert res.step_time_s == pytest.approx(est.step_time_s, rel=TOLERANCE)
    assert res.tokens_per_s == pytest.approx(est.tokens_per_s, rel=TOLERANCE)
    assert res.bubble_fraction == pytest.approx(est.bubble_fraction, abs=0.03)
    assert res.mem_per_device_gb == pytest.approx(est.mem_per_device_gb, rel=0.02)
    assert res.stage_layers == est.stage_layers and res.fits == est.fits


def test_more_steps_take_as_long_each() -> None:
    lay = LayoutSpec(pp=2, pp_schedule="1f1b", micro_batch=4, microbatches=4)
    topo = load_topology("local")
    one, three = simulate(SMALL, topo, lay, ISTHMUS), simulate(SMALL, topo, lay, ISTHMUS, iterations=3)
    assert three.step_times_s == pytest.approx([one.step_time_s] * 3)


def test_zero_bubble_fills_the_1f1b_bubble() -> None:
    topo = load_topology("selene-a100").subset(64)
    work = Workload(get_flavor("llama3-70b"), 64, 2048, "bf16")  # 80 blocks: 5 per ZB-V stage
    base = LayoutSpec(tp=8, sequence_parallel=True, pp=8, micro_batch=1, microbatches=32)
    one = simulate(work, topo, base, ISTHMUS)
    zb = simulate(work, topo, replace(base, pp_schedule="zero_bubble", pp_virtual_stages=2), ISTHMUS)
    assert zb.bubble_fraction < 0.5 * one.bubble_fraction and zb.step_time_s < one.step_time_s


# --- across datacenters ---------------------------------------------------------------------------


def _two_node_geo() -> object:
    topo = load_topology("geo-3dc-h100")
    return replace(topo, datacenters=tuple(replace(d, nodes=2) for d in topo.datacenters))


GEO = [
    LayoutSpec(
        tp=8,
        sequence_parallel=True,
        pp=2,
        dp_replicate=1,
        micro_batch=1,
        microbatches=16,
        datacenters=3,
        dc_axis="dp",
        sync="hierarchical",
    ),
    LayoutSpec(
        tp=8,
        sequence_parallel=True,
        dp_replicate=2,
        micro_batch=1,
        grad_accum=8,
        datacenters=3,
        dc_axis="dp",
        sync="flat",
    ),
    LayoutSpec(
        tp=8,
        sequence_parallel=True,
        dp_replicate=2,
        micro_batch=1,
        grad_accum=8,
        datacenters=3,
        dc_axis="dp",
        sync="compressed",
    ),
    LayoutSpec(
        tp=8,
        sequence_parallel=True,
        pp=2,
        dp_replicate=1,
        micro_batch=1,
        microbatches=16,
        datacenters=3,
        dc_axis="dp",
        sync="diloco",
        inner_steps=50,
    ),
    LayoutSpec(
        tp=8, sequence_parallel=True, pp=3, dp_replicate=2, micro_batch=1, microbatches=24, datacenters=3, dc_axis="pp"
    ),
    LayoutSpec(
        tp=8,
        sequence_parallel=True,
        pp=2,
        dp_replicate=1,
        micro_batch=1,
        microbatches=16,
        datacenters=3,
        dc_axis="dp",
        sync="streaming_diloco",
        inner_steps=20,
        fragments=4,
        overlap_steps=1,
    ),
]


@pytest.mark.parametrize("layout", GEO, ids=[g.label() for g in GEO])
def test_wan_bytes_and_time_follow_the_strategy(layout: LayoutSpec) -> None:
    work = Workload(get_flavor("llama3-8b"), 48, 4096, "bf16")
    res = simulate(work, _two_node_geo(), layout, ISTHMUS, record=True)  # type: ignore[arg-type]
    assert res.wan_bytes_per_step == pytest.approx(res.planner.wan_bytes_per_step, rel=1e-6)
    # The WAN strategies' costs come from the same formulas; where they overlap differently, 10%.
    assert res.step_time_s == pytest.approx(res.planner.step_time_s, rel=0.10)
    assert any(e.track.startswith("link:wan") for e in res.trace_events)


@pytest.mark.parametrize("mbit,tau", [(5, 1), (5, 2), (500, 1)])
def test_streaming_diloco_hides_what_its_overlap_covers(mbit: float, tau: int) -> None:
    """The emulated benchmark's case: small on 2 x 2 half-core ranks, H 20, 4 fragments. The
    simulated fragment transfer and the cost model agree; at 5 Mbit/s a fragment outlasts tau steps
    and blocks for the rest, every H / F steps; at 500 Mbit/s it hides entirely."""
    from isthmus.models.flops import count_params
    from isthmus.planner.cost import estimate

    rate = mbit * 1e6 / 8
    # Without the shared host: the closed form gives every rank a core (Topology.host_cores).
    topo = replace(load_topology("emulated-2dc").with_wan(bandwidth_gb_s=rate / 1e9), host_cores=None)
    lay = LayoutSpec(
        dp_replicate=2,
        datacenters=2,
        dc_axis="dp",
        sync="streaming_diloco",
        inner_steps=20,
        fragments=4,
        overlap_steps=tau,
        micro_batch=4,
        microbatches=1,
    )
    est, sim = estimate(SMALL, topo, lay, ISTHMUS), simulate(SMALL, topo, lay, ISTHMUS)
    assert sim.step_time_s == pytest.approx(est.step_time_s, rel=0.05)
    assert sim.wan_bytes_per_step == pytest.approx(est.wan_bytes_per_step, rel=1e-6)
    # int4 + a scale per 256 elements; each datacenter sends its payload to the other, once per H.
    payload = count_params(SMALL.args) * (0.5 + 4 / 256)
    assert est.wan_bytes_per_step == pytest.approx(2 * payload / 20, rel=1e-6)
    exposed = est.breakdown["wan"]
    if mbit == 500:
        assert exposed == 0.0 and sim.breakdown["wan"] == 0.0
        return
    # One fragment (a quarter of the payload) over the datacenter's link, less tau steps of cover.
    step0 = est.step_time_s - exposed
    assert exposed == pytest.approx((payload / 4 / rate - tau * step0) * 4 / 20, rel=0.02)
    assert sim.breakdown["wan"] == pytest.approx(exposed, rel=0.10)


def test_ranks_sharing_a_hosts_cores_slow_down_only_while_more_compute_than_there_are_cores() -> None:
    """`host_cores` (the emulator's ranks on this machine's cores): a device's compute is a flow on
    the host's cores. Four data-parallel ranks on two cores all compute at once: their ops take
    twice as long. A pipeline of two ranks on two cores: never more than two at once, no change.
    A rank alone never runs faster than its core."""
    from isthmus.planner.topology import parse_topology

    def topo(devices: int, host_cores: int | None) -> object:
        dc = {"name": "dc0", "device": "cpu", "nodes": 1, "devices_per_node": devices}
        dc |= {
            "intra_node": {"bandwidth_gb_s": 100, "latency_us": 1},
            "fabric": {"bandwidth_gb_s": 100, "latency_us": 1},
        }
        data = {"name": "host", "datacenters": [dc]} | ({"host_cores": host_cores} if host_cores else {})
        return parse_topology(data)

    dp4 = LayoutSpec(dp_replicate=4, micro_batch=4)
    alone, shared = (simulate(SMALL, topo(4, c), dp4, ISTHMUS, record=True) for c in (None, 2))  # type: ignore[arg-type]
    ops = {name: [e for e in r.trace_events if e.cat in ("fwd", "bwd")] for name, r in (("a", alone), ("s", shared))}
    assert ops["a"] and [e.end - e.start for e in ops["s"]] == pytest.approx([2 * (e.end - e.start) for e in ops["a"]])
    assert shared.step_time_s > 1.6 * alone.step_time_s
    pp2 = LayoutSpec(pp=2, microbatches=4, micro_batch=4)
    assert simulate(SMALL, topo(2, 2), pp2, ISTHMUS).step_time_s == pytest.approx(  # type: ignore[arg-type]
        simulate(SMALL, topo(2, None), pp2, ISTHMUS).step_time_s,
        rel=1e-9,  # type: ignore[arg-type]
    )
    assert simulate(SMALL, topo(1, 4), LayoutSpec(micro_batch=16), ISTHMUS).step_time_s == pytest.approx(  # type: ignore[arg-type]
        simulate(SMALL, topo(1, None), LayoutSpec(micro_batch=16), ISTHMUS).step_time_s,
        rel=1e-9,  # type: ignore[arg-type]
    )


def test_bad_host_cores_is_one_line() -> None:
    from isthmus.errors import ConfigError
    from isthmus.planner.topology import parse_topology

    dc = {"name": "dc0", "device": "cpu", "nodes": 1, "devices_per_node": 2}
    dc |= {"intra_node": {"bandwidth_gb_s": 1, "latency_us": 1}, "fabric": {"bandwidth_gb_s": 1, "latency_us": 1}}
    for bad in (0, 1.5, "two"):
        with pytest.raises(ConfigError, match="topology.host_cores"):
            parse_topology({"datacenters": [dc], "host_cores": bad})


# --- outputs --------------------------------------------------------------------------------------


def test_trace_has_a_process_per_device_and_link(tmp_path) -> None:  # noqa: ANN001
    lay = LayoutSpec(
        tp=8, sequence_parallel=True, pp=3, dp_replicate=2, micro_batch=1, microbatches=24, datacenters=3, dc_axis="pp"
    )
    work = Workload(get_flavor("llama3-8b"), 48, 4096, "bf16")
    res = simulate(work, _two_node_geo(), lay, ISTHMUS, record=True)  # type: ignore[arg-type]
    path = tmp_path / "t.json"
    n = write_trace(res, path)
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    assert len(events) == n
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert sum(name.startswith("pp rank") for name in names) == 3
    assert sum(name.startswith("WAN") for name in names) >= 2  # east->west and west->... each on its own track
    ops = [e for e in events if e["ph"] == "X" and e["cat"] == "fwd"]
    assert len(ops) == 3 * 24 and any(e["name"] == "F mb3 L0-10" for e in ops)
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")


def test_png_timeline(tmp_path) -> None:  # noqa: ANN001
    pytest.importorskip("matplotlib")
    res = simulate(
        SMALL,
        load_topology("local"),
        LayoutSpec(pp=2, pp_schedule="1f1b", micro_batch=4, microbatches=4),
        ISTHMUS,
        record=True,
    )
    path = tmp_path / "t.png"
    write_png(res, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    import builtins

    from isthmus.errors import IsthmusError

    real = builtins.__import__

    def no_mpl(name: str, *a, **k):  # noqa: ANN002, ANN003, ANN202
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    res = simulate(SMALL, load_topology("local"), LayoutSpec(micro_batch=16), ISTHMUS, record=True)
    with pytest.raises(IsthmusError, match=r"pip install -c constraints.txt -e '\.\[plot\]'"):
        write_png(res, tmp_path / "t.png")
