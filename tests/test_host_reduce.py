"""The shared-memory all-reduce of ranks on one host (`isthmus.parallel.host_reduce`), on real gloo ranks.

Its sums are compared bit for bit: against gloo's own all-reduce on two ranks (a + b in either order
is the same float), and against the rank-order sum on three. Tensor parallelism's numerics through it
are checked against one process in tests/test_parallel_equivalence.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from isthmus.errors import RunFailed
from isthmus.parallel import host_reduce
from isthmus.parallel.host_reduce import SharedMemoryAllReduce, build_all_reduce
from multirank import run_ranks

PREFIX = "isthmus-allreduce-"
# (numel, dtype): one under the first 1 MiB slot, one that grows it to 4 MiB, a smaller one after
# (the grown slots serve it), bf16, and a size that is not a multiple of anything.
CASES = [(8 * 256 * 64, torch.float32), (8 * 256 * 256 * 2, torch.float32), (1000, torch.float32)]
CASES += [(8 * 256 * 256, torch.bfloat16), (12345, torch.float32)]


def _leftovers() -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(PREFIX + "*"))


def _inputs(numel: int, dtype: torch.dtype, rank: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)


def against_gloo() -> list[bool]:
    rank = dist.get_rank()
    reduce = build_all_reduce(dist.group.WORLD, timeout_s=60)
    assert isinstance(reduce, SharedMemoryAllReduce)
    equal = []
    for numel, dtype in CASES:
        mine, theirs = _inputs(numel, dtype, rank), _inputs(numel, dtype, rank)
        reduce(mine)
        dist.all_reduce(theirs)
        equal.append(torch.equal(mine, theirs))
    # A view that is not contiguous goes through gloo, with the same result.
    grid, reference = _inputs(64 * 64, torch.float32, rank).view(64, 64), None
    reference = grid.t().contiguous()
    dist.all_reduce(reference)
    column_major = grid.t()
    reduce(column_major)
    equal.append(torch.equal(column_major, reference))
    assert reduce.slot_bytes == 4 << 20, reduce.slot_bytes  # grew once, to the largest case's power of two
    assert not _leftovers(), _leftovers()  # every map's file was unlinked once all ranks had it
    return equal


def test_two_ranks_sum_bit_for_bit_as_gloo_does() -> None:
    for rank, equal in enumerate(run_ranks(against_gloo, 2)):
        assert all(equal), (rank, equal)


def rank_order_sum() -> torch.Tensor:
    rank = dist.get_rank()
    reduce = build_all_reduce(dist.group.WORLD, timeout_s=60)
    out = _inputs(50_000, torch.float32, rank)
    reduce(out)
    expected = _inputs(50_000, torch.float32, 0) + _inputs(50_000, torch.float32, 1)
    expected += _inputs(50_000, torch.float32, 2)
    assert torch.equal(out, expected), (out - expected).abs().max()
    return out


def test_three_ranks_add_in_rank_order_and_agree() -> None:
    outs = run_ranks(rank_order_sum, 3)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def late_peer() -> str:
    rank = dist.get_rank()
    reduce = build_all_reduce(dist.group.WORLD, timeout_s=0.5)
    t = torch.ones(10)
    reduce(t)  # the first call maps the shared file: every rank takes part
    if rank == 1:
        return ""  # rank 1 never comes to the second call
    with pytest.raises(RunFailed) as err:
        reduce(torch.ones(10))
    return str(err.value)


def test_a_peer_that_never_comes_is_one_line_naming_it_and_the_key() -> None:
    message = run_ranks(late_peer, 2)[0]
    assert message == (
        "tensor-parallel all-reduce: rank(s) [1] of the group did not arrive within parallel.timeout_s = 0.5 s"
    )


def no_room() -> bool:
    """/dev/shm that cannot take the file: every rank falls back to gloo, and the sums stay right."""
    rank = dist.get_rank()
    kept = host_reduce.SHM_DIR
    host_reduce.SHM_DIR = Path("/nonexistent-isthmus-shm")  # creating the file fails as a full tmpfs does
    try:
        reduce = build_all_reduce(dist.group.WORLD, timeout_s=60)
        t, expected = _inputs(4096, torch.float32, rank), _inputs(4096, torch.float32, rank)
        reduce(t)
        dist.all_reduce(expected)
        assert isinstance(reduce, SharedMemoryAllReduce) and not reduce.usable
        return torch.equal(t, expected)
    finally:
        host_reduce.SHM_DIR = kept


def test_no_room_in_dev_shm_falls_back_to_gloo_on_every_rank() -> None:
    assert run_ranks(no_room, 2) == [True, True]
