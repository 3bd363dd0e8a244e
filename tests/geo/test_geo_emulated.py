"""The real trainer across 2 emulated datacenters x 2 ranks over a 20 Mbit/s WAN (`isthmus emulate`).

Three short runs of the `tiny` flavor, started together (each in its own namespaces): flat,
hierarchical and diloco. Hierarchical sums the same gradients in another order, so its losses
equal flat's; it sends fewer bytes over the WAN, and diloco fewer still. Needs root (ip netns, tc),
as CI has; traffic stays inside the namespaces the emulator makes and removes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from procs import isthmus_argv

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
        reason="needs root with ip and tc (network namespaces)",
    ),
]

STEPS = 6


def _start(tmp: Path, sync: str, *extra: str) -> tuple[subprocess.Popen[str], Path]:
    out = tmp / (sync if sync != "none" else "pp_across")
    metrics = out / "metrics.jsonl"
    cmd = isthmus_argv(
        "emulate",
        "--topology",
        "emulated-2dc",
        "--wan-mbit",
        "20",
        "--timeout",
        "150",
        "--log-dir",
        str(out / "logs"),
        "--",
        "train",
        "--config",
        "tiny",
        "--parallel.nproc",
        "4",
        "--geo.sync",
        sync,
        "--train.steps",
        str(STEPS),
        "--train.val_every",
        "0",
        "--train.val_batches",
        "1",
        "--data.max_bytes",
        "200000",
        "--train.run_dir",
        str(out / "run"),
        "--metrics.jsonl",
        str(metrics),
        "--metrics.progress",
        "false",
        *extra,
    )
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, metrics


def _steps(metrics: Path) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("geo_emulated")
    started = {
        "flat": _start(tmp, "flat"),
        "hierarchical": _start(tmp, "hierarchical"),
        "diloco": _start(tmp, "diloco", "--geo.inner_steps", "3"),  # two outer syncs in 6 steps
    }
    # Pipeline stages across the datacenters (geo.dc_axis = pp): stage 0 in dc0, stage 1 in dc1.
    pp = (
        "--geo.dc_axis",
        "pp",
        "--parallel.pp",
        "2",
        "--parallel.dp_replicate",
        "2",
        "--parallel.microbatches",
        "2",
        "--parallel.pp_schedule",
        "1f1b",
    )
    started["pp_across"] = _start(tmp, "none", *pp)
    results = {}
    for name, (proc, metrics) in started.items():
        out, _ = proc.communicate(timeout=200)
        assert proc.returncode == 0, f"{name} failed ({proc.returncode}):\n{out[-3000:]}"
        results[name] = _steps(metrics)
        assert len(results[name]) == STEPS
    return results


def _wan(records: list[dict[str, Any]]) -> int:
    return sum(r["wan_bytes"] for r in records)


def test_hierarchical_losses_equal_flat(runs: dict[str, list[dict[str, Any]]]) -> None:
    flat = [r["loss"] for r in runs["flat"]]
    hier = [r["loss"] for r in runs["hierarchical"]]
    assert hier == pytest.approx(flat, rel=1e-5, abs=1e-6)


def test_hierarchical_sends_less_over_the_wan_than_flat(runs: dict[str, list[dict[str, Any]]]) -> None:
    flat, hier = _wan(runs["flat"]), _wan(runs["hierarchical"])
    assert 0 < hier < flat
    # 2 datacenters x 2 ranks: flat's ring crosses the WAN twice with 2 (n-1)/n = 3/2 of the
    # gradient each; hierarchical's two WAN rings carry a half-shard all-reduce each: 2/3 of flat.
    assert hier / flat == pytest.approx(2 / 3, rel=0.01)


def test_diloco_sends_less_over_the_wan_than_flat(runs: dict[str, list[dict[str, Any]]]) -> None:
    per_step = [r["wan_bytes"] for r in runs["diloco"]]
    assert [b > 0 for b in per_step] == [False, False, True, False, False, True]  # only outer syncs cross
    assert 0 < _wan(runs["diloco"]) < _wan(runs["hierarchical"]) < _wan(runs["flat"])


def test_pipeline_across_datacenters_trains_as_on_one_machine(
    runs: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """pp 2 over the 2 emulated datacenters x dp 2 inside each: the same losses as the same layout on
    local ranks, and every training step's activations and gradients counted on the WAN."""
    from isthmus.cli import main

    metrics = tmp_path / "local.jsonl"
    assert (
        main(
            [
                "train",
                "--config",
                "tiny",
                "--parallel.nproc",
                "4",
                "--parallel.pp",
                "2",
                "--parallel.dp_replicate",
                "2",
                "--parallel.microbatches",
                "2",
                "--parallel.pp_schedule",
                "1f1b",
                "--train.steps",
                str(STEPS),
                "--train.val_every",
                "0",
                "--train.val_batches",
                "1",
                "--data.max_bytes",
                "200000",
                "--train.run_dir",
                str(tmp_path / "run"),
                "--metrics.jsonl",
                str(metrics),
                "--metrics.progress",
                "false",
            ]
        )
        == 0
    )
    local = _steps(metrics)
    across = runs["pp_across"]
    assert [r["loss"] for r in across] == pytest.approx([r["loss"] for r in local], rel=1e-6)
    # Per step: 2 micro-batches x (activation forward + its gradient back) x 2 stage-0 ranks, each
    # micro-batch of 8 / (2 x 2) = 2 rows x 64 tokens x dim 64 in fp32.
    assert [r["wan_bytes"] for r in across] == [2 * 2 * 2 * (2 * 64 * 64 * 4)] * STEPS
