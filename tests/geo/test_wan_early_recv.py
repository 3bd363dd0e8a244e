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
from tests.geo.test_wan_timeshare import LAYOUT
from tests.geo.test_wan_streams import _train


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
