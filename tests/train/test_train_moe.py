"""MoE training in one process: the aux loss, the bias method, capacity, and the expert-load metrics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from isthmus.cli import main

MOE_TINY = [
    "--config",
    "tiny",
    "--model.flavor",
    "moe-tiny",
    "--train.steps",
    "6",
    "--train.val_every",
    "0",
    "--data.max_bytes",
    "100000",
    "--metrics.progress",
    "false",
]


def _train(tmp_path: Path, name: str, *extra: str) -> list[dict]:
    jsonl = tmp_path / f"{name}.jsonl"
    run = ["--train.run_dir", str(tmp_path / name), "--metrics.jsonl", str(jsonl)]
    assert main(["train", *MOE_TINY, *run, "--data.cache_dir", str(tmp_path / "cache"), *extra]) == 0
    return [json.loads(line) for line in jsonl.read_text().splitlines() if '"loss"' in line]


@pytest.mark.slow
def test_moe_trains_with_aux_loss_and_logs_expert_load(tmp_path: Path) -> None:
    records = _train(tmp_path, "aux")
    assert records[-1]["loss"] < records[0]["loss"]
    load = records[-1]["expert_load"]
    assert len(load) == 4 and all(len(row) == 4 and abs(sum(row) - 1) < 1e-3 for row in load)
    assert 0 <= records[-1]["expert_load_min"] <= 1 <= records[-1]["expert_load_max"] <= 2
    assert records[-1]["moe_aux_loss"] >= 1.0  # 1 when perfectly balanced, more otherwise
    assert "tokens_dropped" not in records[-1]
    # The aux loss is per sequence, so accumulating micro-batches computes the same step.
    accum = _train(tmp_path, "accum", "--train.grad_accum", "2")
    np.testing.assert_allclose([r["loss"] for r in accum], [r["loss"] for r in records], rtol=1e-5)


@pytest.mark.slow
def test_bias_method_moves_the_biases_by_the_rate(tmp_path: Path) -> None:
    records = _train(tmp_path, "bias", "--model.load_balance", "bias", "--model.bias_update_rate", "0.01")
    assert "moe_aux_loss" not in records[-1]
    state = torch.load(tmp_path / "bias" / "final" / "model.pt", weights_only=True)
    bias = torch.stack([state[f"layers.{i}.feed_forward.router.expert_bias"] for i in range(4)])
    steps = bias / 0.01  # each a sum of 6 steps of -1, 0 or +1
    assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= 6
    assert bias.max() > 0 > bias.min()  # over- and under-loaded experts moved in opposite directions


@pytest.mark.slow
def test_capacity_factor_reports_dropped_tokens(tmp_path: Path) -> None:
    records = _train(tmp_path, "cap", "--model.capacity_factor", "1.0", "--train.steps", "2")
    assert all(0 <= r["tokens_dropped"] < 0.5 for r in records)
