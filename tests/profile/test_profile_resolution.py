"""`isthmus profile` writes no figure its timings could not resolve: a difference below the noise
or the timer, a negative one, a ratio over an unresolved or zero time. It prints such a figure as
unresolved and leaves its key out of the topology, so the kind keeps its base's value."""

from __future__ import annotations

import tomllib
from dataclasses import replace

import pytest

from isthmus.layout.spec import LayoutSpec
from isthmus.models.flavors import get_flavor
from isthmus.planner.autoplan import local_runtime
from isthmus.planner.cost import estimate
from isthmus.planner.topology import device_kinds, load_topology, parse_topology, shipped_topologies_dir
from isthmus.planner.workload import Workload
from isthmus.profile.measure import (
    MECHANISMS,
    NOISE_SHARE,
    SHARD_EVENTS,
    block_from,
    fit_mechanisms,
    ms,
    ratio,
    times,
    topology_toml,
)


def test_a_block_time_below_the_noise_or_negative_is_unresolved() -> None:
    assert block_from([0.10, 0.30]) == (pytest.approx(0.10), pytest.approx(0.0))
    # The 3-block model no slower than the 1-block one, within the noise, or faster: no block time.
    assert block_from([0.100, 0.100 + 0.5 * NOISE_SHARE * 0.1])[0] is None
    assert block_from([0.100, 0.099])[0] is None
    assert block_from([0.0, 0.0])[0] is None  # below the timer
    # A ratio over an unresolved or zero time is unresolved too (it printed 223144044.50 x).
    assert ratio(0.1, None) is None and ratio(None, 0.1) is None and ratio(0.1, 0.0) is None
    assert ratio(0.2, 0.1) == pytest.approx(2.0)
    assert ms(None) == "unresolved" and times(None) == "unresolved x" and ms(0.0123) == "12.3 ms"


def _steps(tp: float, sp: float, shard: float) -> dict[str, list[float]]:
    """The planner's own 2-rank steps of 1 and 3 blocks plus known per-block work (as measured)."""
    topo = load_topology("local")
    out = {}
    for name, v in MECHANISMS.items():
        d = v.get("dp_shard", 1)
        lay = LayoutSpec(**v, micro_batch=16 // d, microbatches=1)
        extra = (
            2 * (tp + (sp if lay.sequence_parallel else 0.0)) if lay.tp > 1 else SHARD_EVENTS[lay.zero_stage] * shard
        )
        out[name] = [
            estimate(
                Workload(replace(get_flavor("small"), n_layers=n), 16, 128, "fp32"),
                topo.subset(2),
                lay,
                local_runtime(),
            ).step_time_s
            + n * extra
            for n in (1, 3)
        ]
    return out


def test_mechanism_figures_the_steps_do_not_resolve_are_none() -> None:
    text = (shipped_topologies_dir() / "local.toml").read_text()
    # sp cheaper than tp itself (it printed "tp 7.6 ms per pass (sp -7.6 ms)"), FSDP2 within the noise.
    got = fit_mechanisms(text, "small", 16, 128, _steps(tp=3e-3, sp=-4e-3, shard=1e-5))
    assert got["tp_block_s"] == pytest.approx(3e-3, rel=1e-6)
    assert got["sp_block_s"] is None and got["shard_block_s"] is None
    # No tp overhead at all: tp and the sp built on it are unresolved, never 0 or negative.
    got = fit_mechanisms(text, "small", 16, 128, _steps(tp=0.0, sp=1e-3, shard=5e-3))
    assert got["tp_block_s"] is None and got["sp_block_s"] is None
    assert got["shard_block_s"] == pytest.approx(5e-3, rel=1e-6)


def test_the_topology_leaves_unresolved_figures_out_and_loads() -> None:
    prof = {
        "base": device_kinds()["cpu"],
        "threads": 2,
        "flavor": "small",
        "batch": 16,
        "seq": 128,
        "seconds": 1.0,
        "gemms": [(64, 64, 64, 1e9)],
        "fraction": 0.5,
        "half_dim": 16.0,
        "fit_error": 0.01,
        "launch_s": None,
        "launch_floor": 5e-6,
        "memory_bandwidth": None,
        "block_1t": None,
        "block_quarter": None,
        "quarter": 4,
        "block_nt": None,
        "speedup": None,
        "half": 8,
        "shared": None,
        "gloo": [(4096, 1e-4)],
        "gloo_lat": 5e-5,
        "gloo_bw": 1e9,
        "host": None,
        "mechanisms": {"tp": [0.1, 0.3]},
        "overheads": {"tp_block_s": 2e-3, "sp_block_s": None, "shard_block_s": None},
    }
    text = topology_toml(prof, "unresolved", 2)
    raw = tomllib.loads(text)
    kind = raw["devices"]["cpu-local"]
    assert "kernel_launch_us" not in kind and "memory_bandwidth_gb_s" not in kind
    assert kind["tp_block_us"] == 2000 and "sp_block_us" not in kind and "shard_block_us" not in kind
    assert "cpu-local-2t" not in raw["devices"]  # no speed-up measured: the planner estimates it
    assert "sp_block_us: unresolved" in text and "unresolved x" in text
    base = device_kinds()["cpu"]
    loaded = parse_topology(raw).datacenters[0].kind
    assert loaded.kernel_launch_s == base.kernel_launch_s and loaded.peak("fp32") == base.peak("fp32")
