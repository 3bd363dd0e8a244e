"""The shared-memory collectives of ranks on one host (`isthmus.parallel.shm_collectives`), on real gloo
ranks.

Its results are compared bit for bit: against gloo's own all-reduce, all-gather and reduce-scatter on
two ranks (a + b in either order is the same float), and against the rank-order sums on three. Tensor parallelism's numerics through it
are checked against one process in tests/parallel/test_parallel_equivalence.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from isthmus.errors import RunFailed
from isthmus.parallel import shm_collectives
from isthmus.parallel.shm_collectives import SharedMemoryCollectives, build_collectives
from isthmus.planner import memory
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
    reduce = build_collectives(dist.group.WORLD, timeout_s=60)
    assert isinstance(reduce, SharedMemoryCollectives)
    equal = []
    for numel, dtype in CASES:
        mine, theirs = _inputs(numel, dtype, rank), _inputs(numel, dtype, rank)
        reduce.all_reduce(mine)
        dist.all_reduce(theirs)
        equal.append(torch.equal(mine, theirs))
    # A view that is not contiguous goes through gloo, with the same result.
    grid, reference = _inputs(64 * 64, torch.float32, rank).view(64, 64), None
    reference = grid.t().contiguous()
    dist.all_reduce(reference)
    column_major = grid.t()
    reduce.all_reduce(column_major)
    equal.append(torch.equal(column_major, reference))
    assert reduce.slot_bytes == 4 << 20, reduce.slot_bytes  # grew once, to the largest case's power of two
    # The planner's count of the file each rank maps (planner.memory.shared_file_bytes), from the largest tensor.
    assert len(reduce._map) == memory.shared_file_bytes(2, max(n * d.itemsize for n, d in CASES))
    assert not _leftovers(), _leftovers()  # every map's file was unlinked once all ranks had it
    return equal


def test_the_planner_sizes_the_file_as_it_is_laid_out() -> None:
    # planner.memory may not import this module (tests/project/test_import_rules.py): it keeps a copy of the layout.
    assert (memory.SHARED_FILE_LINE, memory.SHARED_FILE_MIN_SLOT, memory.SHARED_FILE_MAX_SLOT) == (
        shm_collectives._LINE,
        shm_collectives._MIN_SLOT,
        shm_collectives._MAX_SLOT,
    )
    assert memory.shared_file_bytes(2, 1000) == 2 * 64 + 4 * (1 << 20)  # the smallest slot
    assert memory.shared_file_bytes(2, (2 << 20) + 1) == 2 * 64 + 4 * (4 << 20)  # the next power of two


def test_two_ranks_sum_bit_for_bit_as_gloo_does() -> None:
    for rank, equal in enumerate(run_ranks(against_gloo, 2)):
        assert all(equal), (rank, equal)


def gather_and_scatter_against_gloo() -> list[bool]:
    """Sequence parallelism's all-gather and reduce-scatter along the sequence of [B, S, D] (and of a
    view that is not contiguous), against gloo's, bit for bit on two ranks."""
    rank = dist.get_rank()
    comm = build_collectives(dist.group.WORLD, timeout_s=60)
    assert isinstance(comm, SharedMemoryCollectives)
    gloo = shm_collectives.BackendCollectives(dist.group.WORLD)
    equal = []
    for shape, dtype in (((4, 64, 32), torch.float32), ((2, 256, 256), torch.bfloat16), ((3, 10, 7), torch.float32)):
        x = _inputs(math.prod(shape), dtype, rank).view(shape)
        equal.append(torch.equal(comm.all_gather(x, 1), gloo.all_gather(x, 1)))
        equal.append(torch.equal(comm.reduce_scatter(x, 1), gloo.reduce_scatter(x, 1)))
        equal.append(comm.all_gather(x, 1).shape == (shape[0], 2 * shape[1], shape[2]))
    strided = _inputs(64 * 8 * 4, torch.float32, rank).view(8, 64, 4).transpose(0, 1)  # [64, 8, 4], not contiguous
    equal.append(torch.equal(comm.all_gather(strided, 1), gloo.all_gather(strided, 1)))
    equal.append(torch.equal(comm.reduce_scatter(strided, 1), gloo.reduce_scatter(strided, 1)))
    assert comm.seq > 0 and not _leftovers()  # shared memory served them
    return equal


def test_two_ranks_gather_and_scatter_bit_for_bit_as_gloo_does() -> None:
    for rank, equal in enumerate(run_ranks(gather_and_scatter_against_gloo, 2)):
        assert all(equal), (rank, equal)


def rank_order_sum() -> torch.Tensor:
    rank = dist.get_rank()
    reduce = build_collectives(dist.group.WORLD, timeout_s=60)
    out = _inputs(50_000, torch.float32, rank)
    reduce.all_reduce(out)
    expected = _inputs(50_000, torch.float32, 0) + _inputs(50_000, torch.float32, 1)
    expected += _inputs(50_000, torch.float32, 2)
    assert torch.equal(out, expected), (out - expected).abs().max()
    # The reduce-scatter: this rank's third of the sequence, summed in the same order.
    full = [_inputs(2 * 9 * 4, torch.float32, r).view(2, 9, 4) for r in range(3)]
    mine = reduce.reduce_scatter(full[rank], 1)
    assert torch.equal(mine, (full[0] + full[1] + full[2])[:, 3 * rank : 3 * rank + 3]), mine
    assert torch.equal(reduce.all_gather(mine, 1), (full[0] + full[1] + full[2]))
    return out


def test_three_ranks_add_in_rank_order_and_agree() -> None:
    outs = run_ranks(rank_order_sum, 3)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def late_peer() -> str:
    rank = dist.get_rank()
    reduce = build_collectives(dist.group.WORLD, timeout_s=0.5)
    t = torch.ones(10)
    reduce.all_reduce(t)  # the first call maps the shared file: every rank takes part
    if rank == 1:
        return ""  # rank 1 never comes to the second call
    with pytest.raises(RunFailed) as err:
        reduce.all_reduce(torch.ones(10))
    return str(err.value)


def test_a_peer_that_never_comes_is_one_line_naming_it_and_the_key() -> None:
    message = run_ranks(late_peer, 2)[0]
    assert message == (
        "tensor-parallel collective: rank(s) [1] of the group did not arrive within parallel.timeout_s = 0.5 s"
    )


def no_room() -> bool:
    """/dev/shm that cannot take the file: every rank falls back to gloo, and the sums stay right."""
    rank = dist.get_rank()
    kept = shm_collectives.SHM_DIR
    shm_collectives.SHM_DIR = Path("/nonexistent-isthmus-shm")  # creating the file fails as a full tmpfs does
    try:
        reduce = build_collectives(dist.group.WORLD, timeout_s=60)
        t, expected = _inputs(4096, torch.float32, rank), _inputs(4096, torch.float32, rank)
        reduce.all_reduce(t)
        dist.all_reduce(expected)
        assert isinstance(reduce, SharedMemoryCollectives) and not reduce.usable
        return torch.equal(t, expected)
    finally:
        shm_collectives.SHM_DIR = kept


def test_no_room_in_dev_shm_falls_back_to_gloo_on_every_rank() -> None:
    assert run_ranks(no_room, 2) == [True, True]


def test_ranks_on_one_host_agree_and_another_dev_shm_is_another_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One hostname and one boot do not make one host: a container with a /dev/shm of its own (here,
    a directory on another file system standing in for it) cannot open the files this one creates."""
    here = shm_collectives._host_id()
    assert shm_collectives._host_id() == here
    if tmp_path.stat().st_dev == shm_collectives.SHM_DIR.stat().st_dev:
        pytest.skip("the temporary directory is on the /dev/shm file system itself")
    monkeypatch.setattr(shm_collectives, "SHM_DIR", tmp_path)
    assert shm_collectives._host_id() != here
