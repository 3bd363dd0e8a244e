"""``geo.pp_compression``: a pipeline across two datacenters with encoded boundary tensors.

pp 2 across 2 datacenters (gloo, two real processes, ``tiny``): each method's losses stay within 2%
of the exact run's at every step (4 steps: the first step's loss differs only by the encoded
activations, the later ones by the updates the encoded gradients made), and the ``wan_bytes`` each
step logs are what :func:`wire_bytes` says: 2 microbatches x (an activation out + its gradient back)
of (batch / 2) x seq_len tokens. lowrank runs over 2 connections (``geo.wan_streams``): the payload is
what is striped. Exact boundaries staying bit-identical is covered by
tests/geo/test_wan_streams.py::test_striped_runs_equal_one_stream (and tests/geo/test_geo_run.py), which
run the same pipeline with the setting at its default.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from isthmus.cli import main
from isthmus.layout.wire import wire_bytes

BATCH, SEQ, DIM, MICROBATCHES = 8, 64, 64, 2  # the tiny config's batch and seq_len, the tiny flavor's dim
PIPELINE = ["--parallel.pp", "2", "--parallel.microbatches", str(MICROBATCHES)]
PIPELINE += ["--geo.datacenters", "2", "--geo.dc_axis", "pp"]


def _train(tmp: Path, name: str, *flags: str) -> list[dict[str, float]]:
    metrics = tmp / f"{name}.jsonl"
    argv = ["train", "--config", "tiny", "--parallel.nproc", "2", "--train.steps", "4", "--train.val_every", "0"]
    argv += ["--train.val_batches", "1", "--data.max_bytes", "200000", "--train.run_dir", str(tmp / name)]
    argv += ["--metrics.jsonl", str(metrics), "--metrics.progress", "false", *PIPELINE, *flags]
    assert main(argv) == 0
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]


@pytest.mark.slow
def test_compressed_boundaries_train_close_to_exact_and_count_their_bytes(tmp_path: Path) -> None:
    exact = _train(tmp_path, "none")
    tokens = BATCH // MICROBATCHES * SEQ
    assert [r["wan_bytes"] for r in exact] == [2 * MICROBATCHES * wire_bytes("none", tokens, DIM, 4, 0)] * 4
    for method, rank, extra in (("int8", 0, ()), ("int4", 0, ()), ("lowrank", 16, ("--geo.wan_streams", "2"))):
        flags = ["--geo.pp_compression", method, *extra]
        if method == "lowrank":
            flags += ["--geo.pp_compression_rank", str(rank)]
        runs = _train(tmp_path, method, *flags)
        assert len(runs) == 4
        for mine, ref in zip(runs, exact, strict=True):
            assert abs(mine["loss"] - ref["loss"]) <= 0.02 * ref["loss"], (method, mine["loss"], ref["loss"])
            assert mine["wan_bytes"] == 2 * MICROBATCHES * wire_bytes(method, tokens, DIM, 4, rank), method
        assert runs[0]["loss"] != exact[0]["loss"]  # the encoding did something


def test_compression_needs_a_boundary_between_datacenters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["train", "--config", "tiny", "--parallel.nproc", "2", "--train.run_dir", str(tmp_path / "run")]
    assert main([*base, "--geo.pp_compression", "int8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "isthmus: error: geo.pp_compression = 'int8': needs a pipeline boundary between datacenters"
        " (geo.dc_axis = pp, geo.datacenters > 1, parallel.pp > 1)"
    ]
    assert main([*base, *PIPELINE, "--geo.pp_compression", "lowrank", "--geo.pp_compression_rank", "65"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "isthmus: error: geo.pp_compression_rank = 65: must be between 1 and model.dim = 64"
    ]
    assert not (tmp_path / "run").exists()  # rejected before any work
