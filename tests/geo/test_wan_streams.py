"""``geo.wan_streams``: a cross-datacenter transfer split over several connections gives the same bytes.

The striped primitives (all-reduce, all-gather, send/receive) against torch's own on 2 gloo ranks,
then the trainer: a pipeline whose stages sit in two datacenters (``geo.dc_axis = pp``), and
streaming DiLoCo, whose inter-datacenter int4 all-gathers are striped, each run with one stream and
with several. The losses and gradient norms of every step must be equal exactly
(fp32, ==): striping moves bytes, it does no arithmetic (an all-reduce over 2 datacenters adds two
values, in either order the same).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from tests.multirank import run_ranks

from isthmus.cli import main


def _striped_equals_plain() -> list[bool]:
    import torch.distributed as dist

    from isthmus.parallel.striped import (
        stripe_groups,
        striped_all_gather,
        striped_all_reduce,
        striped_recv,
        striped_send,
    )

    rank = dist.get_rank()
    extra = stripe_groups([[0, 1]], 3)
    groups = [dist.group.WORLD, *(g[0] for g in extra)]
    gen = torch.Generator().manual_seed(7 + rank)
    ok = []
    for n in (1, 2, 5, 1001):  # fewer elements than stripes, and an odd count
        x = torch.randn(n, 3, generator=gen)
        plain, striped = x.clone(), x.clone()
        dist.all_reduce(plain)
        striped_all_reduce(striped, groups).wait()
        ok.append(torch.equal(plain, striped))
        out_plain, out_striped = torch.empty(2 * n * 3), torch.full((2 * n * 3,), float("nan"))
        dist.all_gather_single(out_plain, x.view(-1))
        striped_all_gather(out_striped, x.view(-1), groups).wait()
        ok.append(torch.equal(out_plain, out_striped))
        sent = (torch.arange(3 * n, dtype=torch.float32).view(n, 3) * 1.5).t()  # not contiguous
        if rank == 0:
            striped_send(sent, groups, 1).wait()
        else:
            got = torch.full((3, n), float("nan"))
            striped_recv(got, groups, 0).wait()
            ok.append(torch.equal(got, sent))
    return ok


@pytest.mark.slow
def test_striped_primitives_move_the_same_bytes() -> None:
    for ok in run_ranks(_striped_equals_plain, 2, timeout=120):
        assert all(ok)


def _train(tmp: Path, name: str, *flags: str) -> list[tuple[float, float]]:
    metrics = tmp / f"{name}.jsonl"
    argv = [
        "train",
        "--config",
        "tiny",
        "--parallel.nproc",
        "2",
        "--train.steps",
        "4",
        "--train.val_every",
        "0",
        "--train.val_batches",
        "1",
        "--data.max_bytes",
        "200000",
        "--train.run_dir",
        str(tmp / name),
        "--metrics.jsonl",
        str(metrics),
        "--metrics.progress",
        "false",
        *flags,
    ]
    assert main(argv) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in records if "loss" in r]


PIPELINE = (
    "--parallel.pp",
    "2",
    "--parallel.microbatches",
    "2",
    "--geo.datacenters",
    "2",
    "--geo.dc_axis",
    "pp",
)
STREAMING = (
    "--geo.datacenters",
    "2",
    "--geo.sync",
    "streaming_diloco",
    "--geo.inner_steps",
    "2",
    "--geo.fragments",
    "2",
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "layout", "streams"),
    [("pipeline", PIPELINE, 4), ("streaming", STREAMING, 3)],
)
def test_striped_runs_equal_one_stream(tmp_path: Path, name: str, layout: tuple[str, ...], streams: int) -> None:
    one = _train(tmp_path, f"{name}-1", *layout)
    several = _train(tmp_path, f"{name}-{streams}", *layout, "--geo.wan_streams", str(streams))
    assert len(one) == 4 and several == one
    # The transfers were striped (else the equality says nothing): rank 0's log counts them.
    log = (tmp_path / f"{name}-{streams}" / "logs" / "rank0.log").read_text()
    found = re.search(rf"geo.wan_streams = {streams}: this rank split (\d+) pipeline transfer\(s\) and (\d+) sync", log)
    assert found is not None, log[-2000:]
    pipeline, sync = map(int, found.groups())
    if name == "pipeline":  # 4 steps x 2 microbatches x (activation out + its gradient back)
        assert (pipeline, sync) == (16, 0)
    else:
        assert pipeline == 0 and sync > 0
