"""``geo.wan_schedule = time_shared``: the pipelines crossing one WAN link take it in turn.

A real run (4 gloo ranks): 2 datacenters x 2 pipelines x pp 2, the stage boundary between the
datacenters, 1F1B with 4 microbatches (warmup, steady 1B1F and cooldown all cross the boundary).
Time sharing only orders the transfers, so losses and gradient norms equal fair sharing exactly,
with one connection and striped over several; the receivers log the turns they took (else the
equality says nothing).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tests.geo.test_wan_streams import _train

LAYOUT = (
    "--parallel.nproc",
    "4",
    "--parallel.pp",
    "2",
    "--parallel.dp_replicate",
    "2",
    "--parallel.microbatches",
    "4",
    "--parallel.pp_schedule",
    "1f1b",
    "--train.batch_size",
    "8",
    "--geo.datacenters",
    "2",
    "--geo.dc_axis",
    "pp",
)


@pytest.mark.slow
@pytest.mark.parametrize("streams", [1, 2])
def test_time_shared_runs_equal_fair_sharing(tmp_path: Path, streams: int) -> None:
    wan = ("--geo.wan_streams", str(streams))
    fair = _train(tmp_path, "fair", *LAYOUT, *wan)
    shared = _train(tmp_path, "shared", *LAYOUT, *wan, "--geo.wan_schedule", "time_shared")
    assert len(fair) == 4 and shared == fair
    held = {}
    for rank in range(4):
        log = (tmp_path / "shared" / "logs" / f"rank{rank}.log").read_text()
        found = re.search(r"time_shared: this rank took (\d+) turn\(s\) on the WAN, held .*?: (.*)", log)
        assert found is not None, log[-2000:]
        # Each rank receives one side's transfers: 4 steps x 4 microbatches.
        assert int(found.group(1)) == 16
        held[rank] = [tuple(map(float, pair.split(","))) for pair in found.group(2).split()]
    # The receivers of one direction (the two replicas of a stage, one datacenter: ranks 0 and 1
    # receive gradients, 2 and 3 activations) never hold the link at once, and alternate.
    for a, b in ((0, 1), (2, 3)):
        spans = sorted([(s, e, a) for s, e in held[a]] + [(s, e, b) for s, e in held[b]])
        assert all(e1 <= s2 for (_, e1, _), (s2, _, _) in zip(spans, spans[1:], strict=False))
        assert [r for _, _, r in spans] == [a, b] * 16
