"""What isthmus's training step costs over a hand-written torch loop, for DDP and FSDP (ZeRO-3).

Two gloo ranks (one thread each) build four setups on the same model (`build_model` +
`init_weights`, same seed) and the same batches (`BatchSampler` over the same tokens):
isthmus's `Trainer` with dp_replicate 2 and with dp_shard 2 / zero 3, and the textbook loops
(`DistributedDataParallel(model)`; `fully_shard` per block + root) with AdamW(foreach=False),
cross-entropy, clip_grad_norm_, step, zero_grad. The setups take turns, round after round, in one
run, so that machine noise falls on both sides alike; short rounds (many turns) matter more
than long ones on a shared 2-core machine, where a noisy stretch lasts seconds.

    python benchmarks/dp_overhead.py [--flavor small] [--rounds 6] [--steps 10] [--warmup 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from isthmus.train.short_run import capped

ORDER = ("isthmus ddp", "plain ddp", "isthmus fsdp", "plain fsdp")
# Step = run one optimizer step; the bool asks it to return the pre-clip gradient norm.
Step = Callable[[bool], float | None]


def isthmus_step(opts: argparse.Namespace, layout: list[str], root: str) -> tuple[Step, object]:
    """The real trainer, built exactly as `isthmus train` builds it; returns its step and data."""
    from isthmus.config import build_config, parse_overrides
    from isthmus.train.trainer import Trainer

    args = [
        "--model.flavor",
        opts.flavor,
        "--train.steps",
        "100000",
        "--train.threads",
        "1",
        "--train.val_every",
        "0",
        "--data.max_bytes",
        "400000",
        "--metrics.progress",
        "false",
        "--train.run_dir",
        f"{root}/run{'_'.join(layout)}",
        "--data.cache_dir",
        f"{root}/cache",
        "--parallel.nproc",
        "2",
        *layout,
    ]
    trainer = Trainer(build_config(None, parse_overrides(args)))

    def step(record: bool) -> float | None:
        _, norm = trainer.train_step()
        return norm if record else None

    return step, trainer


def plain_step(trainer: object, fsdp: bool) -> Step:
    """The textbook loop on the same model, init and batches, without any isthmus machinery."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from isthmus.data.loader import BatchSampler
    from isthmus.models.llama import build_model, init_weights

    cfg, a = trainer.cfg.train, trainer.model_args  # type: ignore[attr-defined]
    model = build_model(a, device="cpu")
    init_weights(model, cfg.seed, a)
    if fsdp:
        mesh = init_device_mesh("cpu", (2,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay, foreach=False
    )
    sampler = BatchSampler(trainer.data.train, cfg.seq_len, cfg.seed)  # type: ignore[attr-defined]
    rank, world = dist.get_rank(), dist.get_world_size()

    def step(record: bool) -> float | None:
        x, y = sampler.next_batch(cfg.batch_size, rank, world)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not record:
            return None
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    return step


def _bench(rank: int, opts: argparse.Namespace, port: int, root: str, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)  # 2 ranks on 2 cores: more threads would only oversubscribe
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ddp_step, ddp_trainer = isthmus_step(opts, ["--parallel.dp_replicate", "2"], root)
    fsdp_step, _ = isthmus_step(opts, ["--parallel.dp_shard", "2", "--parallel.zero_stage", "3"], root)
    steps: dict[str, Step] = {
        "isthmus ddp": ddp_step,
        "plain ddp": plain_step(ddp_trainer, fsdp=False),
        "isthmus fsdp": fsdp_step,
        "plain fsdp": plain_step(ddp_trainer, fsdp=True),
    }
    times: dict[str, list[float]] = {name: [] for name in ORDER}
    first_norm: dict[str, float] = {}
    for r in range(opts.rounds):
        # Odd rounds swap each pair, so neither side always runs right after the other kind.
        order = ORDER if r % 2 == 0 else ("plain ddp", "isthmus ddp", "plain fsdp", "isthmus fsdp")
        for name in order:
            for i in range(opts.warmup):  # re-warm after the other setups ran (caches, allocator)
                norm = steps[name](r == 0 and i == 0)
                if norm is not None:
                    first_norm[name] = norm
            dist.barrier()
            for _ in range(opts.steps):
                # Every step ends in collectives both ranks join, so rank 0's wall time is the step's.
                t0 = time.perf_counter()
                steps[name](False)
                times[name].append(time.perf_counter() - t0)
    if rank == 0:
        torch.save({"times": times, "first_norm": first_norm}, out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="small")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per setup per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before each timed block")
    opts = ap.parse_args()
    # ISTHMUS_MAX_STEPS (a smoke run, as the docs' commands run in the tests) caps every loop.
    opts.rounds = capped(opts.rounds)
    opts.steps = capped(opts.steps)
    opts.warmup = capped(opts.warmup)
    if opts.warmup < 1:
        ap.error("--warmup must be at least 1 (the first warm-up step records the gradient norm)")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as root:
        out = f"{root}/times.pt"
        mp.start_processes(_bench, args=(opts, port, root, out), nprocs=2, start_method="spawn")
        res = torch.load(out)
    times, first_norm = res["times"], res["first_norm"]
    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}

    from rich.console import Console
    from rich.table import Table

    table = Table(
        "setup",
        "median step ms",
        "min ms",
        "max ms",
        "steps timed",
        "step-1 grad norm",
        title=f"{opts.flavor}, 2 gloo ranks x 1 thread, {opts.rounds} rounds x {opts.steps} steps "
        f"(+{opts.warmup} warm-up each)",
    )
    for name in ORDER:
        ts = times[name]
        table.add_row(
            name,
            f"{med[name]:.1f}",
            f"{min(ts) * 1e3:.1f}",
            f"{max(ts) * 1e3:.1f}",
            str(len(ts)),
            f"{first_norm[name]:.6f}",
        )
    Console(width=160).print(table)
    for kind in ("ddp", "fsdp"):
        ratio = med[f"isthmus {kind}"] / med[f"plain {kind}"]
        # The fastest step is what is left when no other process took the cores: a second view,
        # less swayed than the median by a loaded stretch of the run.
        fastest = min(times[f"isthmus {kind}"]) / min(times[f"plain {kind}"])
        print(
            f"{kind}: isthmus / plain median step time = {ratio:.3f} ({(ratio - 1) * 100:+.1f}%), "
            f"fastest step {fastest:.3f} ({(fastest - 1) * 100:+.1f}%)"
        )
    # Per round, so a drift of the machine during the run shows instead of hiding in the median.
    n = opts.steps
    for kind in ("ddp", "fsdp"):
        per_round = [
            statistics.median(times[f"isthmus {kind}"][r * n : (r + 1) * n])
            / statistics.median(times[f"plain {kind}"][r * n : (r + 1) * n])
            for r in range(opts.rounds)
        ]
        print(f"{kind}: per-round ratios " + ", ".join(f"{x:.3f}" for x in per_round))


if __name__ == "__main__":
    main()
