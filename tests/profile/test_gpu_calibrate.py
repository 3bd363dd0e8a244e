"""benchmarks/gpu_calibrate.py, the prepared run for a lent GPU, on this machine's CPU at small shapes.

The script is what a GPU lease runs in its few minutes, so it must work before one is lent: ``--device
cpu --quick`` runs every part of it (the `isthmus train` correctness pair, the GEMM fit, memory,
attention, gloo in place of NCCL, the timed steps against the planner) and writes the same files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from isthmus.planner.topology import parse_topology

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_calibrate.py"


@pytest.mark.slow
def test_quick_run_on_cpu_writes_a_kind_the_planner_reads(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "calibration.json").read_text())
    one = report["correctness"]["cpu 1 device"]
    assert len(one["losses"]) == 4 and one["max_rel_diff"] == 0.0 and one["ok"]  # the same device: the same bits
    assert 0 < report["gemm"]["gemm_max_fraction"] <= 1 and report["gemm"]["samples"]
    assert report["memory"]["bandwidth_gb_s"] > 0 and report["memory"]["kernel_launch_us"] > 0
    assert all(r["fwd_ms"] > 0 and r["flash_backward_factor"] > 0 for r in report["attention"])
    assert all(r["attention_fraction"] > 0 for r in report["attention"])
    assert report["collectives"]["backend"] == "gloo" and report["collectives"]["world"] == 2
    first = report["steps"]["rows"][0]
    # The whole-program fraction is solved on the first layout: its prediction is its measurement.
    assert first["predicted_s"]["solved"] == pytest.approx(first["measured_s"], rel=0.01)
    table = tomllib.loads((tmp_path / "device.toml").read_text())
    kind = table["devices"]["cpu-measured"]
    assert kind["base"] == "cpu" and 0 < kind["attention_fraction"] <= 1
    link = {"bandwidth_gb_s": 1, "latency_us": 10}
    topo = parse_topology(
        {
            "devices": table["devices"],
            "datacenters": [
                {
                    "name": "x",
                    "device": "cpu-measured",
                    "nodes": 1,
                    "devices_per_node": 1,
                    "intra_node": link,
                    "fabric": link,
                }
            ],
        }
    )
    assert topo.datacenters[0].kind.gemm_max_fraction == pytest.approx(kind["gemm_max_fraction"])


@pytest.mark.slow
def test_asking_for_cuda_without_a_gpu_is_one_line() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, also on a machine that has one
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "no CUDA device" in done.stderr, done.stderr
