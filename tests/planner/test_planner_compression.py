"""The planner prices the WAN's lossy encodings and chooses them only as the quality table allows.

Compressed pipeline boundaries (``geo.pp_compression``) send ``wire.wire_bytes`` and pay
``encode_flops`` at both ends; DiLoCo's topk2 outer gradients send ``wire.topk2_payload_nbytes``; a
lossy method is chosen only when ``compression.toml`` holds a measured loss within its tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from isthmus.cli import plan as plan_cli
from isthmus.cli.common import ArgumentParser
from isthmus.errors import ConfigError
from isthmus.geo import compress
from isthmus.layout import wire
from isthmus.layout.choices import DILOCO_SYNCS
from isthmus.layout.spec import LayoutSpec
from isthmus.models.flavors import get_flavor
from isthmus.planner import compression
from isthmus.planner.cost import estimate
from isthmus.planner.explain import trades
from isthmus.planner.search import SearchSpace, search
from isthmus.planner.topology import load_topology
from isthmus.planner.workload import RUNTIMES, Workload
from isthmus.sim import simulate

RT = RUNTIMES["isthmus"]
WAN_100M = load_topology("emulated-2dc").with_wan(bandwidth_gb_s=100e6 / 8 / 1e9, latency_us=40_000)
"""Two emulated datacenters joined at 100 Mbit/s with 80 ms round trips (issue 35's operating point)."""
WORK = Workload(get_flavor("small"), 16, 256, "fp32")
PIPE = LayoutSpec(pp=2, dp_replicate=2, micro_batch=2, microbatches=4, datacenters=2, dc_axis="pp")
"""pp 2 across the WAN: one boundary between the datacenters, 2 pipelines over it."""


def test_a_compressed_boundary_sends_the_codecs_bytes_and_pays_its_arithmetic() -> None:
    exact = estimate(WORK, WAN_100M, PIPE, RT)
    tokens, dim = PIPE.micro_batch * WORK.seq_len, WORK.args.dim
    # Activations forward and gradients back, every microbatch of both pipelines, fp32.
    assert exact.wan_bytes_per_step == 2 * WORK.tokens_per_step * dim * 4
    kind = WAN_100M.datacenters[0].kind
    for method in ("int8", "int4", "lowrank"):
        est = estimate(WORK, WAN_100M, PIPE.with_(pp_compression=method), RT)
        sent = wire.wire_bytes(method, tokens, dim, 4, PIPE.pp_compression_rank)
        assert est.wan_bytes_per_step == pytest.approx(exact.wan_bytes_per_step * sent / (tokens * dim * 4))
        assert est.breakdown["wan"] < exact.breakdown["wan"] and est.step_time_s < exact.step_time_s
        # Each end encodes or decodes one message forward and one back per microbatch: its half of
        # encode_flops twice, at the device's GEMM rate.
        half = wire.encode_flops(method, tokens, dim, PIPE.pp_compression_rank) / 2
        per_microbatch = 2 * half / (kind.peak("fp32") * kind.gemm_max_fraction)
        assert est.breakdown["compression"] == pytest.approx(PIPE.microbatches * per_microbatch)
    assert "compression" not in exact.breakdown


def test_boundaries_inside_a_datacenter_stay_exact() -> None:
    one_dc = LayoutSpec(pp=2, micro_batch=2, microbatches=4)
    for lay in (one_dc, PIPE.with_(dc_axis="dp", pp=1, microbatches=1, dp_replicate=1, grad_accum=4)):
        exact = estimate(WORK, WAN_100M, lay, RT)
        asked = estimate(WORK, WAN_100M, lay.with_(pp_compression="int4"), RT)
        assert (asked.step_time_s, asked.wan_bytes_per_step) == (exact.step_time_s, exact.wan_bytes_per_step)


def test_a_compressed_pipeline_simulates_its_bytes_and_codec_time() -> None:
    lay = PIPE.with_(pp_compression="lowrank")
    sim = simulate(WORK, WAN_100M, lay, RT)
    assert sim.wan_bytes_per_step == pytest.approx(sim.planner.wan_bytes_per_step)
    assert sim.breakdown["compression"] == pytest.approx(sim.planner.breakdown["compression"])


@pytest.mark.parametrize("sync", DILOCO_SYNCS)
def test_topk2_outer_gradients_are_priced_at_their_payload(sync: str) -> None:
    lay = LayoutSpec(
        dp_replicate=2, micro_batch=4, grad_accum=2, datacenters=2, dc_axis="dp", sync=sync, inner_steps=10, fragments=2
    )
    auto = estimate(WORK, WAN_100M, lay, RT)
    # auto is what each kind sent before outer_dtype was priced: fp32 for diloco, int4 for streaming.
    resolved = "fp32" if sync == "diloco" else "int4"
    assert estimate(WORK, WAN_100M, lay.with_(outer_dtype=resolved), RT).wan_bytes_per_step == auto.wan_bytes_per_step
    int4 = estimate(WORK, WAN_100M, lay.with_(outer_dtype="int4"), RT)
    topk2 = estimate(WORK, WAN_100M, lay.with_(outer_dtype="topk2"), RT)
    n = 1024 * 256
    k = wire.topk2_chunk_k(256, lay.outer_density)
    ratio = wire.topk2_payload_nbytes(n, 256, k) / compress.payload_nbytes(n, "int4", 256)
    assert topk2.wan_bytes_per_step == pytest.approx(int4.wan_bytes_per_step * ratio)
    assert int4.wan_bytes_per_step / topk2.wan_bytes_per_step == pytest.approx(12.9, abs=0.05)
    sim = simulate(WORK, WAN_100M, topk2.layout, RT)
    assert sim.wan_bytes_per_step == pytest.approx(topk2.wan_bytes_per_step)


def _table(tmp_path: Path, int4: float | None) -> Path:
    path = tmp_path / "compression.toml"
    penalty = "" if int4 is None else f"loss_penalty = {int4}\n"
    path.write_text(f'tolerance = 0.01\n[pp_compression.int4]\ncommand = "python benchmarks/x.py"\n{penalty}')
    return path


@pytest.mark.parametrize(("int4", "chosen"), [(None, "none"), (0.05, "none"), (0.002, "int4")])
def test_the_plan_chooses_a_lossy_boundary_only_within_the_measured_tolerance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, int4: float | None, chosen: str
) -> None:
    monkeypatch.setattr(compression, "QUALITY_FILE", _table(tmp_path, int4))
    space = SearchSpace({"dc_axis": "pp", "tp": 1, "pp": 2, "micro_batch": 2}, batch_size=16, seq_len=256)
    res = search(WORK.args, WAN_100M, space, RT, top=3, dtype="fp32")
    assert res.best.layout.pp_compression == chosen
    lines = trades(res, WAN_100M)
    int4_line = next(line for line in lines if line.strip().startswith("int4 boundaries"))
    words = {None: "loss unmeasured", 0.05: "over tolerance", 0.002: "within tolerance"}[int4]
    assert "fewer WAN bytes" in int4_line and words in int4_line, int4_line
    assert "loss unmeasured" in next(line for line in lines if line.strip().startswith("int8 boundaries"))


def plan(argv: list[str]) -> int:
    parser = ArgumentParser(prog="isthmus")
    sub = parser.add_subparsers(dest="command", parser_class=ArgumentParser)
    plan_cli.add_parser(sub)
    return plan_cli.run(parser.parse_args(["plan", *argv]))


def test_the_flag_reaches_the_planner(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--model.flavor", "small", "--topology", "emulated-2dc", "--train.batch_size", "16"]
    common += ["--train.seq_len", "256", "--parallel.tp", "1", "--geo.dc_axis", "pp", "--top", "1"]
    assert plan([*common, "--geo.pp_compression", "int8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["layouts"][0]
    assert best["geo"]["pp_compression"] == "int8" and "pc-int8" in best["label"]
    assert any(line.strip().startswith("int4 boundaries") for line in out["trades"])
    with pytest.raises(ConfigError, match="geo.outer_density"):
        plan([*common, "--geo.outer_density", "0"])


@pytest.mark.parametrize(("topk2", "chosen"), [(0.0258, "auto"), (0.004, "topk2")])
def test_the_search_tries_topk2_outer_gradients_only_within_the_tolerance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, topk2: float, chosen: str
) -> None:
    path = tmp_path / "compression.toml"
    path.write_text(f'tolerance = 0.01\n[outer_dtype.topk2]\nloss_penalty = {topk2}\ncommand = "python x.py"\n')
    monkeypatch.setattr(compression, "QUALITY_FILE", path)
    fixed = {"dc_axis": "dp", "tp": 1, "micro_batch": 4, "inner_steps": 10, "dp_shard": 1}
    space = SearchSpace(fixed, batch_size=16, seq_len=256, sync=("diloco",))
    res = search(WORK.args, WAN_100M, space, RT, top=3, dtype="fp32")
    assert res.best.layout.outer_dtype == chosen
    line = next(line for line in trades(res, WAN_100M) if "topk2 outer gradients" in line)
    assert ("within tolerance" if chosen == "topk2" else "over tolerance") in line, line
