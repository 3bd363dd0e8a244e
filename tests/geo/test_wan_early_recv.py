"""``geo.pp_early_recv``: a step's cross-datacenter receives posted ahead.

A real run (4 gloo ranks): 2 datacenters x 2 pipelines x pp 2, the stage boundary between the
datacenters, 4 microbatches. Posting ahead only moves when a receive is posted, so losses and
gradient norms equal receives posted on use exactly, under 1F1B on one connection and under GPipe
striped over two connections with int4 boundaries (the receive then decodes on its wait); each rank
logs how many receives it posted ahead (else the equality says nothing).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tests.geo.test_wan_streams import _train
from tests.geo.test_wan_timeshare import LAYOUT

from isthmus.cli.main import main


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ("--parallel.pp_schedule", "1f1b"),
        ("--parallel.pp_schedule", "gpipe", "--geo.wan_streams", "2", "--geo.pp_compression", "int4"),
    ],
    ids=["1f1b", "gpipe_striped_int4"],
)
def test_receives_posted_ahead_train_as_posted_on_use(tmp_path: Path, extra: tuple[str, ...]) -> None:
    on_use = _train(tmp_path, "on_use", *LAYOUT, *extra)
    ahead = _train(tmp_path, "ahead", *LAYOUT, *extra, "--geo.pp_early_recv", "true")
    assert len(on_use) == 4 and ahead == on_use
    for rank in range(4):
        log = (tmp_path / "ahead" / "logs" / f"rank{rank}.log").read_text()
        found = re.search(r"geo.pp_early_recv: this rank posted (\d+) receive\(s\)", log)
        assert found is not None, log[-2000:]
        # Each rank receives one side's transfers (activations on stage 1, gradients on stage 0):
        # 4 steps x 4 microbatches, all but none posted on use.
        assert int(found.group(1)) == 16


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        ((), "needs a pipeline boundary between datacenters (geo.dc_axis = pp, geo.datacenters > 1, parallel.pp > 1)"),
        (
            (*LAYOUT, "--geo.wan_schedule", "time_shared"),
            "needs geo.wan_schedule = fair: time_shared posts each receive on its turn, which is how it orders the link",
        ),
        (
            (*LAYOUT, "--parallel.pp_schedule", "interleaved_1f1b", "--parallel.pp_virtual_stages", "2"),
            "needs one stage per rank (parallel.pp_schedule gpipe or 1f1b, not interleaved_1f1b)",
        ),
    ],
    ids=["no_boundary", "time_shared", "interleaved"],
)
def test_receives_ahead_refused_where_they_cannot_apply(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], why: str
) -> None:
    argv = [
        "train",
        "--config",
        "tiny",
        "--train.run_dir",
        str(tmp_path / "run"),
        *flags,
        "--geo.pp_early_recv",
        "true",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"isthmus: error: geo.pp_early_recv = True: {why}"), err
    assert not (tmp_path / "run").exists()  # rejected before any work
