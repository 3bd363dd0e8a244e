"""The runtime as features: defaults by topology, one feature set from the command line, what each
prices, and the plans a user gets on an H100 cluster (issue 34's targets)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from isthmus.cli.main import main as isthmus_main
from isthmus.layout.spec import LayoutSpec
from isthmus.models.flavors import get_flavor
from isthmus.planner.cost import estimate
from isthmus.planner.topology import load_topology
from isthmus.planner.workload import RUNTIMES, Workload


def _run(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert isthmus_main(list(argv)) == 0
    return out.getvalue()


def _plan_json(*argv: str) -> dict:
    return json.loads(_run("plan", *argv, "--json", "--top", "1"))


def test_the_default_runtime_is_todays_stack_on_gpus_and_isthmus_on_cpus() -> None:
    gpu = _plan_json("--model.flavor", "llama3-8b", "--topology", "eos-h100", "--gpus", "8", "--train.batch_size", "16")
    cpu = _plan_json("--model.flavor", "tiny", "--train.batch_size", "8", "--train.seq_len", "64")
    assert gpu["layouts"][0]["runtime"] == "current"
    assert cpu["layouts"][0]["runtime"].startswith("isthmus")


def test_a_feature_flag_sets_one_feature_and_the_output_says_so() -> None:
    text = _run(
        "plan", "--model.flavor", "llama3-8b", "--topology", "eos-h100", "--gpus", "8", "--train.batch_size", "16",
        "--runtime.tp_overlap", "bulk", "--top", "1",
    )  # fmt: skip
    assert "assumed software: current[tp_overlap=bulk] (tp_overlap bulk, dp_overlap true" in text


def _step(layout: LayoutSpec, dtype: str = "bf16", **features: object) -> float:
    work = Workload(get_flavor("llama3-70b"), 64, 8192, dtype)
    topo = load_topology("eos-h100").subset(64)
    return estimate(work, topo, layout, RUNTIMES["current"].with_features(**features)).step_time_s


TP8 = LayoutSpec(tp=8, sequence_parallel=True, dp_shard=8, zero_stage=1, micro_batch=1, grad_accum=8)


def test_tensor_parallel_overlap_hides_collectives_in_order() -> None:
    none, bulk, pipelined = (_step(TP8, tp_overlap=x) for x in ("none", "bulk", "pipelined"))
    assert pipelined < bulk < none


def test_fp8_is_faster_than_bf16_and_tensorwise_faster_than_rowwise() -> None:
    bf16, tensorwise, rowwise = _step(TP8), _step(TP8, "fp8"), _step(TP8, "fp8", fp8_recipe="rowwise")
    assert tensorwise < rowwise and tensorwise < 0.85 * bf16


def test_unfused_pointwise_kernels_and_an_unfused_loss_cost_time() -> None:
    assert _step(TP8, fused_pointwise=False) > _step(TP8)
    assert _step(TP8, fused_cross_entropy=False) > _step(TP8)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flavor", "gpus", "batch", "best_published"),
    [
        ("llama3-8b", 64, 256, 14451),  # Megatron-Bridge 25.11, DGX-H100, FP8 (8 GPUs, data parallel)
        ("llama3-70b", 64, 256, 1664),  # Megatron-Bridge 26.04.01, tp 4 pp 8 v 5
        ("llama3-405b", 1024, 1536, 328),  # Megatron-Bridge 26.04.01, tp 8 pp 8 cp 2 v 8
    ],
)
def test_the_plan_on_an_h100_cluster_is_within_10_percent_of_the_best_published(
    flavor: str, gpus: int, batch: int, best_published: float
) -> None:
    res = _plan_json(
        "--model.flavor", flavor, "--topology", "eos-h100", "--gpus", str(gpus), "--train.batch_size", str(batch),
        "--train.seq_len", "8192", "--train.dtype", "fp8",
    )  # fmt: skip
    best = res["layouts"][0]
    assert best["what_if"] is None
    assert best["tokens_per_s"] / gpus == pytest.approx(best_published, rel=0.10)
    assert "It assumes the software does" in res["explanation"]
