"""`isthmus profile` writes a topology the planner loads; local ranks; `--parallel.plan auto`."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from isthmus.cli import profile as profile_cli
from isthmus.cli.common import ArgumentParser
from isthmus.config import build_config
from isthmus.errors import IsthmusError
from isthmus.planner.autoplan import choose_local_layout, local_topology, threads_per_rank
from isthmus.planner.topology import load_topology
from isthmus.profile.device import PEAK_CACHE_FILE, cpu_peak_key
from isthmus.profile.measure import fit_alpha_beta, fit_gemm_curve
from procs import descendants, isthmus_argv, session_gone


def profile(argv: list[str]) -> int:
    parser = ArgumentParser(prog="isthmus")
    sub = parser.add_subparsers(dest="command", parser_class=ArgumentParser)
    profile_cli.add_parser(sub)
    return profile_cli.run(parser.parse_args(["profile", *argv]))


@pytest.mark.slow
def test_profile_writes_a_loadable_topology(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ISTHMUS_CACHE", str(tmp_path / "cache"))
    peaks = tmp_path / "cache" / PEAK_CACHE_FILE
    peaks.parent.mkdir()
    peaks.write_text(json.dumps({cpu_peak_key("fp32", 1): {"flops": 1.0, "measured_at": 0}}))
    out = tmp_path / "me.toml"
    quick = ["--seconds", "0.5", "--threads", "2", "--model", "tiny", "--batch", "4", "--seq-len", "32"]
    assert profile(["--out", str(out), *quick]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "CPU peak for MFU: 1 thread(s)" in printed
    # The CPU peaks behind MFU were measured again: the absurd cached one is replaced.
    cached = json.loads(peaks.read_text())
    assert {cpu_peak_key(d, t) for t in (1, 2) for d in ("fp32", "bf16")} == set(cached)
    assert all(entry["flops"] > 1e9 for entry in cached.values())
    topo = load_topology(str(out))
    dc = topo.datacenters[0]
    assert dc.kind.name == "cpu-local" and dc.devices >= 1
    # Plausible units, not a speed: a 0.5 s budget times small all-reduces only, and on a busy machine
    # gloo's loopback fit has come out at 68 MB/s (CI, 2026-12-05); bytes/s read as bits or GB/s would
    # miss these bounds by 8x or 1e9x.
    assert 1e7 < dc.intra_node.bandwidth < 1e11 and 0 < dc.intra_node.latency < 0.01
    assert 0 < dc.kind.gemm_max_fraction <= 1 and dc.kind.kernel_launch_s > 0
    # The 2-rank layouts ran for real: their per-block runtime work is written down (0 or more).
    text = out.read_text()
    assert "tp_block_us" in text and "shard_block_us" in text
    assert dc.kind.tp_block_s >= 0 and dc.kind.shard_block_s >= 0 and dc.kind.tp_block_s + dc.kind.sp_block_s >= 0
    two = local_topology(1, str(out), cores=2)  # one rank with both cores: the profiled 2-thread kind
    assert two.datacenters[0].kind.name == "cpu-local-2t"
    assert two.datacenters[0].kind.peak("fp32") > 0  # faster than one thread on an idle machine; not when loaded


def test_bad_profile_flags(tmp_path: Path) -> None:
    with pytest.raises(IsthmusError, match="--seconds = 0.0: must be positive"):
        profile(["--out", str(tmp_path / "x.toml"), "--seconds", "0"])
    with pytest.raises(IsthmusError, match="--out = .*: its directory does not exist"):
        profile(["--out", str(tmp_path / "no" / "x.toml")])


def test_fits_recover_known_constants() -> None:
    peak, frac, d0 = 200e9, 0.8, 12.0
    shapes = [(64, 64, 64), (256, 256, 256), (2048, 256, 256), (2048, 2048, 2048), (256, 704, 2048)]
    samples = [(m, n, k, peak * frac * m / (m + d0) * n / (n + d0) * k / (k + d0)) for m, n, k in shapes]
    f, d, err = fit_gemm_curve(samples, peak)
    assert f == pytest.approx(frac, rel=0.01) and d == pytest.approx(d0, abs=0.5) and err < 0.01
    lat, bw = 150e-6, 1.1e9
    lat_fit, bw_fit = fit_alpha_beta([(n, 2 * lat + n / bw) for n in (4096, 65536, 1 << 20, 1 << 24, 1 << 26)])
    assert lat_fit == pytest.approx(lat, rel=1e-6) and bw_fit == pytest.approx(bw, rel=1e-6)
    # A slow small message (a loaded machine) drowns the bytes' time: the fit falls back to the
    # smallest message's time and the largest one's throughput, never an absurd bandwidth.
    noisy = [(4096, 0.03), (65536, 0.031), (1 << 20, 0.029), (1 << 24, 0.03), (1 << 26, 0.03)]
    lat_fit, bw_fit = fit_alpha_beta(noisy)
    assert lat_fit == pytest.approx(0.015) and bw_fit == pytest.approx((1 << 26) / 0.03)


def test_local_ranks_share_the_cores() -> None:
    assert threads_per_rank(1, 2) == 2 and threads_per_rank(2, 2) == 1 and threads_per_rank(4, 2) == 1
    base = load_topology("local").datacenters[0]
    one, two, four = (local_topology(n, "local", cores=2).datacenters[0] for n in (1, 2, 4))
    assert (one.devices, two.devices, four.devices) == (1, 2, 4)
    assert two.kind.peak("fp32") == base.kind.peak("fp32") and two.intra_node == base.intra_node
    assert one.kind.peak("fp32") > base.kind.peak("fp32")  # two threads
    # Four ranks on two cores: each gets half a core, and so does its share of gloo.
    assert four.kind.peak("fp32") == pytest.approx(base.kind.peak("fp32") / 2)
    assert four.intra_node.bandwidth == pytest.approx(base.intra_node.bandwidth / 2)


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_plan_auto_chooses_a_valid_local_layout(nproc: int) -> None:
    cfg = build_config(
        None,
        [
            ("model.flavor", "small"),
            ("parallel.nproc", str(nproc)),
            ("train.batch_size", "16"),
            ("train.seq_len", "128"),
        ],
    )
    choice = choose_local_layout(cfg)
    par = choice.parallel
    assert par["nproc"] == nproc
    product = par["dp_replicate"] * par["dp_shard"] * par["tp"] * par["cp"] * par["pp"]
    assert product == nproc and choice.summary.startswith("plan auto: ")
    assert "\n" not in choice.summary and math.isfinite(choice.estimate.step_time_s)
    # The values apply to the config as they are, and the result passes the trainer's own checks.
    from isthmus.config import set_value
    from isthmus.layout.dims import check_layout

    for key, value in {**par, **{f"train.{k}": v for k, v in choice.train.items()}}.items():
        set_value(cfg, key if key.startswith("train.") else f"parallel.{key}", value, from_cli=False)
    check_layout(cfg, 4, 2, 4)


@pytest.mark.slow
def test_train_plan_auto_runs_the_choice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`isthmus train --parallel.plan auto` prints the planner's choice and trains with it on real ranks."""
    import tomllib

    from isthmus.cli import main

    run = tmp_path / "auto"
    argv = [
        "train",
        "--model.flavor",
        "tiny",
        "--train.steps",
        "3",
        "--train.val_every",
        "0",
        "--train.val_batches",
        "1",
        "--train.batch_size",
        "8",
        "--train.seq_len",
        "32",
        "--metrics.progress",
        "false",
        "--parallel.nproc",
        "2",
        "--parallel.plan",
        "auto",
        "--train.run_dir",
        str(run),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("plan auto: "))
    written = tomllib.loads((run / "config.toml").read_text())["parallel"]
    degrees = written["dp_replicate"] * written["dp_shard"] * written["tp"] * written["cp"] * written["pp"]
    assert degrees == 2 and written["plan"] == "auto" and "on 2 local rank(s)" in line
    lines = [ln for ln in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in ln and "val" not in ln]
    assert len(lines) == 3


def test_plan_auto_keeps_what_the_command_line_fixes(capsys: pytest.CaptureFixture[str]) -> None:
    import tomllib

    from isthmus.cli import main

    base = ["train", "--model.flavor", "small", "--parallel.plan", "auto", "--print-config"]
    assert main([*base, "--parallel.nproc", "4", "--parallel.tp", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# plan auto: ") and "tp2" in out.splitlines()[0]
    par = tomllib.loads(out)["parallel"]  # the comment keeps --print-config's output valid TOML
    assert par["tp"] == 2 and par["dp_replicate"] * par["dp_shard"] * par["cp"] * par["pp"] == 2
    assert main([*base, "--parallel.nproc", "2", "--parallel.pp", "2", "--parallel.pp_schedule", "gpipe"]) == 0
    par = tomllib.loads(capsys.readouterr().out)["parallel"]
    assert (par["pp"], par["pp_schedule"], par["dp_replicate"] * par["dp_shard"]) == (2, "gpipe", 1)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--parallel.tp", "3"], "parallel.tp = 3: must divide parallel.nproc = 2"),
        (["--parallel.nproc", "4", "--parallel.tp", "4"], "parallel.tp = 4: must divide model.n_kv_heads = 2"),
        (["--parallel.pp", "2", "--parallel.pp_virtual_stages", "4"], "8 stages is more than model.n_layers = 4"),
        (
            ["--parallel.plan_topology", "nowhere.toml"],
            "parallel.plan_topology = 'nowhere.toml': no such file or preset",
        ),
        (["--parallel.plan", "sometimes"], "parallel.plan = 'sometimes'"),
        (
            ["--parallel.nproc", "4", "--geo.datacenters", "2"],
            "parallel.plan = 'auto': plans the local ranks of one datacenter",
        ),
    ],
)
def test_plan_auto_bad_input_is_one_line(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from isthmus.cli import main

    assert main(["train", "--model.flavor", "small", "--parallel.plan", "auto", "--print-config", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("isthmus: error: ") and message in err, err


def _with_overheads(tp_us: float, sp_us: float, shard_us: float) -> str:
    """Two ranks of the shipped cpu kind on one node, with the given runtime work per block."""
    return (
        f'name = "t"\n[devices.cpu-o]\nbase = "cpu"\ntp_block_us = {tp_us}\nsp_block_us = {sp_us}\n'
        f'shard_block_us = {shard_us}\n[[datacenters]]\nname = "local"\ndevice = "cpu-o"\nnodes = 1\n'
        "devices_per_node = 2\nintra_node = { bandwidth_gb_s = 1.2, latency_us = 200 }\n"
    )


def test_runtime_overheads_enter_cost_model_and_simulator_alike() -> None:
    """Measured per-block runtime work: tp per block and pass, FSDP2 per block and collective."""
    import tomllib

    from isthmus.layout.spec import LayoutSpec
    from isthmus.models.flavors import get_flavor
    from isthmus.planner.autoplan import local_runtime
    from isthmus.planner.cost import estimate
    from isthmus.planner.topology import parse_topology
    from isthmus.planner.workload import Workload
    from isthmus.sim import simulate

    plain = parse_topology(tomllib.loads(_with_overheads(0, 0, 0)))
    over = parse_topology(tomllib.loads(_with_overheads(1000, 500, 2000)))
    assert over.datacenters[0].kind.tp_block_s == pytest.approx(1e-3)
    work, rt = Workload(get_flavor("small"), 16, 128, "fp32"), local_runtime()
    cases = [  # layout, seconds the overheads add (4 blocks)
        (LayoutSpec(tp=2, micro_batch=16, microbatches=1), 4 * 2 * 1e-3),
        (LayoutSpec(tp=2, sequence_parallel=True, micro_batch=16, microbatches=1), 4 * 2 * 1.5e-3),
        (LayoutSpec(dp_shard=2, zero_stage=3, micro_batch=8, microbatches=1), 4 * 3 * 2e-3),
        (LayoutSpec(dp_shard=2, zero_stage=2, micro_batch=8, microbatches=1), 4 * 2 * 2e-3),
        (LayoutSpec(dp_replicate=2, micro_batch=8, microbatches=1), 0.0),
    ]
    for lay, added in cases:
        a, b = estimate(work, plain, lay, rt).step_time_s, estimate(work, over, lay, rt).step_time_s
        assert b - a == pytest.approx(added, rel=1e-6, abs=1e-9), lay.label()
        sim = simulate(work, over, lay, rt)
        assert sim.step_time_s == pytest.approx(b, rel=0.03), lay.label()
    # Time-sliced ranks (4 on 2 cores) take twice as long for the same work.
    four = local_topology(4, str(_write(_with_overheads(1000, 500, 2000))), cores=2).datacenters[0].kind
    assert four.tp_block_s == pytest.approx(2e-3) and four.shard_block_s == pytest.approx(4e-3)


def test_tensor_parallel_collectives_take_the_host_memory_path_on_the_cpu_runtime() -> None:
    """Where the profile measured the shared-memory all-reduce, the CPU runtime prices tensor
    parallelism's collectives with it (all-reduces, and sequence parallelism's all-gathers and
    reduce-scatters; cost model and simulator alike); another runtime and a topology without the
    path keep the node's link."""
    import tomllib
    from dataclasses import replace

    from isthmus.layout.spec import LayoutSpec
    from isthmus.models.flavors import get_flavor
    from isthmus.planner.autoplan import local_runtime
    from isthmus.planner.cost import estimate
    from isthmus.planner.topology import parse_topology
    from isthmus.planner.workload import Workload
    from isthmus.sim import simulate

    host = "[[datacenters]]\nhost_memory = { bandwidth_gb_s = 10.0, latency_us = 20 }\n"
    text = _with_overheads(0, 0, 0)
    with_host = parse_topology(tomllib.loads(text.replace("[[datacenters]]\n", host, 1)))
    without = parse_topology(tomllib.loads(text))
    assert with_host.datacenters[0].host_memory is not None and without.datacenters[0].host_memory is None
    work, rt = Workload(get_flavor("small"), 16, 128, "fp32"), local_runtime()
    tp = LayoutSpec(tp=2, micro_batch=16, microbatches=1)
    fast, slow = estimate(work, with_host, tp, rt).step_time_s, estimate(work, without, tp, rt).step_time_s
    assert fast < slow
    assert simulate(work, with_host, tp, rt).step_time_s == pytest.approx(fast, rel=0.03)
    gloo_runtime = replace(rt, tp_host_memory=False)
    assert estimate(work, with_host, tp, gloo_runtime).step_time_s == pytest.approx(slow)
    # Sequence parallelism's all-gathers and reduce-scatters take the same path.
    sp = LayoutSpec(tp=2, sequence_parallel=True, micro_batch=16, microbatches=1)
    assert estimate(work, with_host, sp, rt).step_time_s < estimate(work, without, sp, rt).step_time_s
    assert estimate(work, with_host, sp, gloo_runtime).step_time_s == pytest.approx(
        estimate(work, without, sp, rt).step_time_s
    )
    # Time-sliced ranks (4 on 2 cores) get half of the path, as of the node's links.
    four = local_topology(4, str(_write(text.replace("[[datacenters]]\n", host, 1))), cores=2).datacenters[0]
    assert four.host_memory is not None and four.host_memory.bandwidth == pytest.approx(5e9)


def _write(text: str) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp()) / "t.toml"
    path.write_text(text)
    return path


def test_mechanism_fit_recovers_known_overheads() -> None:
    """Steps made of the planner's own prediction plus known per-block work give that work back."""
    from dataclasses import replace as dc_replace

    from isthmus.layout.spec import LayoutSpec
    from isthmus.models.flavors import get_flavor
    from isthmus.planner.autoplan import local_runtime
    from isthmus.planner.cost import estimate
    from isthmus.planner.workload import Workload
    from isthmus.profile.measure import MECHANISMS, SHARD_EVENTS, fit_mechanisms

    text = (Path(__file__).resolve().parents[2] / "topologies" / "local.toml").read_text()
    topo = load_topology("local")
    tp, sp, shard = 3e-3, 1e-3, 5e-3
    measured = {}
    for name, v in MECHANISMS.items():
        d = v.get("dp_shard", 1)
        lay = LayoutSpec(
            tp=v.get("tp", 1),
            sequence_parallel=v.get("sequence_parallel", False),
            dp_shard=d,
            zero_stage=v.get("zero_stage", 1),
            micro_batch=16 // d,
            microbatches=1,
        )
        per_block = (
            2 * (tp + (sp if lay.sequence_parallel else 0.0)) if lay.tp > 1 else SHARD_EVENTS[lay.zero_stage] * shard
        )
        measured[name] = [
            estimate(
                Workload(dc_replace(get_flavor("small"), n_layers=n), 16, 128, "fp32"),
                topo.subset(2),
                lay,
                local_runtime(),
            ).step_time_s
            + n * per_block
            + 0.01
            for n in (1, 3)
        ]
    got = fit_mechanisms(text, "small", 16, 128, measured)
    assert got["tp_block_s"] == pytest.approx(tp, rel=1e-6) and got["sp_block_s"] == pytest.approx(sp, rel=1e-6)
    assert got["shard_block_s"] == pytest.approx(shard, rel=1e-6)


def test_bad_overhead_key_is_one_line() -> None:
    import tomllib

    from isthmus.errors import ConfigError
    from isthmus.planner.topology import parse_topology

    with pytest.raises(
        ConfigError, match=r"devices.cpu-o.tp_block_us = -1: must be a number of microseconds, 0 or more"
    ):
        parse_topology(tomllib.loads(_with_overheads(-1, 0, 0)))


@pytest.mark.slow
def test_ctrl_c_during_the_two_rank_measurements_is_one_line(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the whole process group) while the measurements' two processes run: the
    command's one line and exit 130, no traceback from those processes, and nothing of it left."""
    out = tmp_path / "me.toml"
    argv = ["profile", "--out", str(out), "--seconds", "5", "--model", "tiny", "--batch", "4", "--seq-len", "32"]
    proc = subprocess.Popen(
        isthmus_argv(*argv), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        # The launcher, the resource tracker, the rank server and the two measuring processes.
        while len(descendants(proc.pid)) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, "the two-rank measurements never started"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    assert err.splitlines() == ["isthmus: interrupted"], err[-3000:]
    assert not session_gone(proc.pid), "a process of the profile outlived it"
    assert not out.exists()
