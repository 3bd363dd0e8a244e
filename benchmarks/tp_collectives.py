"""Tensor parallelism's communication pieces on 2 local ranks: the all-reduce, and sequence parallelism's
all-gather and reduce-scatter, through gloo and through shared memory, and the vocab-parallel loss
against torch's loss_parallel.

    python benchmarks/tp_collectives.py              # 40 calls per figure
    python benchmarks/tp_collectives.py --calls 100

Two gloo ranks of one thread. Each all-reduce figure is ``--calls`` calls of one size, a barrier
before each, rank 0's time per call: best and median; each call sums a fresh copy of the tensor
(as the trainer sums a freshly computed activation), the copy timed with it on both paths. The sizes are the debug shape's activation
[8, 256, 256] in fp32 (2 MiB, what a tp 2 block all-reduces twice forward and twice backward) and a
half and a quarter of it. Sequence parallelism's pair moves the same activations along the sequence
(dim 1): the all-gather of a rank's half [8, 128, 256] into the whole, the reduce-scatter of the
whole into a half. Each call's result is compared with gloo's: shared memory must give the same
bits. The loss figures are the forward and backward of the mean cross-entropy of [8, 256, 2048]
logits sharded over the vocabulary: torch's `loss_parallel` on a DTensor against isthmus's
`vocab_parallel_cross_entropy`, and, for scale, a plain cross-entropy of one rank's half alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers_common as pc  # noqa: E402
from isthmus.train.short_run import capped  # noqa: E402

SIZES = (8 * 256 * 64, 8 * 256 * 128, 8 * 256 * 256)
LOGITS = (8, 256, 2048)


def timed(fn: Callable[[], None], calls: int) -> tuple[float, float]:
    """(best, median) seconds of ``calls`` calls, a barrier before each (after 3 untimed)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def _rank(rank: int, calls: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    from isthmus.parallel.shm_collectives import BackendCollectives, SharedMemoryCollectives, build_collectives
    from isthmus.parallel.tp import vocab_parallel_cross_entropy

    pc.init_gloo(rank)
    shm = build_collectives(dist.group.WORLD, timeout_s=120)
    assert isinstance(shm, SharedMemoryCollectives), "the two ranks share this host: shared memory must serve"
    gloo_comm = BackendCollectives(dist.group.WORLD)
    rows = []
    for numel in SIZES:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        a, b = x.clone(), x.clone()
        shm.all_reduce(a)
        dist.all_reduce(b)
        same = torch.equal(a, b)
        gloo = timed(lambda: dist.all_reduce(x.clone()), calls)
        shared = timed(lambda: shm.all_reduce(x.clone()), calls)
        rows.append(
            f"| {numel * 4 / 2**20:.1f} MiB | {_ms(gloo)} | {_ms(shared)} | {gloo[1] / shared[1]:.1f}x | {same} |"
        )

    sequence = []
    whole = torch.randn(8, 256, 256, generator=torch.Generator().manual_seed(rank))
    half = whole[:, :128].contiguous()
    for name, x, op in (("all-gather", half, "all_gather"), ("reduce-scatter", whole, "reduce_scatter")):
        same = torch.equal(getattr(shm, op)(x, 1), getattr(gloo_comm, op)(x, 1))
        gloo = timed(lambda: getattr(gloo_comm, op)(x, 1), calls)  # noqa: B023 (timed at once)
        shared = timed(lambda: getattr(shm, op)(x, 1), calls)  # noqa: B023
        sequence.append(f"| {name} | {_ms(gloo)} | {_ms(shared)} | {gloo[1] / shared[1]:.1f}x | {same} |")

    mesh = init_device_mesh("cpu", (2,))
    local = torch.randn(*LOGITS[:2], LOGITS[2] // 2, requires_grad=True)
    targets = torch.randint(0, LOGITS[2], LOGITS[:2], generator=torch.Generator().manual_seed(0))

    def torch_loss() -> None:
        logits = DTensor.from_local(local, mesh, [Shard(-1)], run_check=False)
        with loss_parallel():
            F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1)).backward()

    def own_loss() -> None:
        vocab_parallel_cross_entropy(DTensor.from_local(local, mesh, [Shard(-1)], run_check=False), targets).backward()

    def half_alone() -> None:
        F.cross_entropy(local.flatten(0, 1), (targets % (LOGITS[2] // 2)).flatten(0, 1)).backward()

    losses = [
        (name, timed(fn, calls))
        for name, fn in (
            ("torch loss_parallel", torch_loss),
            ("isthmus vocab_parallel_cross_entropy", own_loss),
            ("plain cross-entropy of one rank's half, alone", half_alone),
        )
    ]
    if rank == 0:
        print(f"2 gloo ranks x 1 thread, {calls} calls per figure (best / median ms per call)")
        print()
        print("| all-reduce, fp32 | gloo | shared memory | gloo / shared (medians) | same bits |")
        print("|---|---:|---:|---:|---|")
        print("\n".join(rows))
        print()
        print(
            "| along the sequence of [8, 256, 256] fp32 | gloo | shared memory | gloo / shared (medians) | same bits |"
        )
        print("|---|---:|---:|---:|---|")
        print("\n".join(sequence))
        print()
        print(f"| loss of {list(LOGITS)} logits, forward + backward | best / median ms |")
        print("|---|---:|")
        for name, t in losses:
            print(f"| {name} | {_ms(t)} |")
    dist.barrier()
    dist.destroy_process_group()


def _ms(t: tuple[float, float]) -> str:
    return f"{t[0] * 1e3:.2f} / {t[1] * 1e3:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=40, help="timed calls per figure (best and median printed)")
    opts = ap.parse_args()
    if opts.calls < 1:
        ap.error("--calls must be at least 1")
    calls = capped(opts.calls)  # ISTHMUS_MAX_STEPS (the docs test): a smoke run
    pc.spawn_ranks(_rank, (calls,), pc.WORLD)


if __name__ == "__main__":
    main()
