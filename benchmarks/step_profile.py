"""Where a training step's time goes, rank by rank: busy in torch's ops, idle, and the costliest ops.

    python benchmarks/step_profile.py --mode pp                  # a peers.py mode, its debug shape
    python benchmarks/step_profile.py --nproc 1 --flags "--model.flavor small"
    python benchmarks/step_profile.py --nproc 2 --flags "--model.flavor small --parallel.tp 2 --train.threads 1"
    python benchmarks/step_profile.py --nproc 2 --free-tp-collectives --flags "--model.flavor small --parallel.tp 2 --parallel.sequence_parallel true --train.threads 1"

Each rank builds the real `Trainer` (``--mode``: exactly as benchmarks/peers.py builds isthmus for
that mode, 2 gloo ranks of one thread, its random-token data; ``--flags``: `isthmus train`'s flags,
on ``--nproc`` ranks), runs ``--warmup`` steps, times ``--steps`` steps one by one (a barrier
before each, so a step's time is the slowest rank's), then profiles ``--profiled`` steps with
torch.profiler. Printed per rank: the median step, its busy time (the profiled ops' self time per
step: compute and the CPU work of collectives), the rest (waiting: for a peer's data, a pipeline's
fill and drain, a collective's partner), and the ``--top`` ops by self time per step.

``--free-tp-collectives`` makes tensor parallelism's collectives local work alone: no exchange and
no wait, only what each must build on its own rank (the whole tensor of an all-gather, the shard of
a reduce-scatter; an all-reduce is nothing). The numbers are then wrong and the step is a bound:
the fastest tensor parallelism could run with collectives that cost nothing (as peers.py's DDP
bound is DDP without its all-reduce).

What it is for: the measured reason behind a ratio in docs/benchmarks.md (how much of a pipeline
rank's step is the schedule's idle time; where tensor parallelism's time goes against one process).
"""

from __future__ import annotations

import argparse
import collections
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import peers_common as pc  # noqa: E402
from isthmus.train.short_run import capped  # noqa: E402


def build_trainer(opts: argparse.Namespace, root: str) -> Any:
    from isthmus.config import build_config, parse_overrides
    from isthmus.train.trainer import Trainer

    if opts.mode:
        import peers

        return peers.isthmus_trainer(opts.mode, root, False)
    flags = [*shlex.split(opts.flags), "--parallel.nproc", str(opts.nproc), "--data.cache_dir", f"{root}/cache"]
    flags += ["--train.steps", "100000", "--train.val_every", "0", "--metrics.progress", "false"]
    return Trainer(build_config(None, parse_overrides([*flags, "--train.run_dir", f"{root}/run"])))


def free_tp_collectives() -> None:
    """Replace tensor parallelism's collectives, on whichever path serves them, by the local work each
    must do anyway (see the module docstring). A patch of this process's classes, before the model is
    built: the bound is a measurement aid, not a mode of the trainer."""
    from isthmus.parallel import shm_collectives

    def all_reduce(self: Any, t: torch.Tensor) -> None:
        return None

    def all_gather(self: Any, t: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat([t] * self.world, dim=dim)

    def reduce_scatter(self: Any, t: torch.Tensor, dim: int) -> torch.Tensor:
        chunk = t.shape[dim] // self.world
        return t.narrow(dim, torch.distributed.get_rank(self.group) * chunk, chunk).contiguous()

    for cls in (shm_collectives.BackendCollectives, shm_collectives.SharedMemoryCollectives):
        cls.all_reduce, cls.all_gather, cls.reduce_scatter = all_reduce, all_gather, reduce_scatter  # type: ignore[method-assign]


def profile_rank(rank: int, opts: argparse.Namespace, root: str) -> dict[str, Any]:
    """This rank's median step, busy seconds per step and costliest ops (seconds per step)."""
    from torch.profiler import ProfilerActivity, profile

    if opts.free_tp_collectives:
        free_tp_collectives()

    def barrier() -> None:
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    trainer = build_trainer(opts, root)
    for _ in range(opts.warmup):
        trainer.train_step()
    times = []
    for _ in range(opts.steps):
        barrier()
        t0 = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - t0)
    barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(opts.profiled):
            trainer.train_step()
    per_op: collections.Counter[str] = collections.Counter()
    for event in prof.key_averages():
        per_op[event.key] += event.self_cpu_time_total / 1e6 / opts.profiled
    return {"step": statistics.median(times), "busy": sum(per_op.values()), "top": per_op.most_common(opts.top)}


def _rank_main(rank: int, opts: argparse.Namespace, root: str) -> None:
    pc.init_gloo(rank, opts.nproc)  # one thread, as peers.py's ranks; --flags runs set theirs with --train.threads
    res = profile_rank(rank, opts, root)
    Path(root, f"rank{rank}.json").write_text(json.dumps(res))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def report(results: list[dict[str, Any]], what: str) -> None:
    print(what)
    for rank, r in enumerate(results):
        # Busy comes from the profiled steps, which the profiler slows a little: it can pass the step.
        idle = max(0.0, r["step"] - r["busy"])
        print()
        print(
            f"rank {rank}: step {r['step'] * 1e3:.1f} ms (median), busy {r['busy'] * 1e3:.1f} ms, "
            f"waiting {idle * 1e3:.1f} ms ({idle / r['step']:.0%} of the step)"
        )
        print("| op | ms per step | share of busy |")
        print("|---|---:|---:|")
        for name, s in r["top"]:
            print(f"| `{name[:70]}` | {s * 1e3:.1f} | {s / r['busy']:.0%} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=sorted(pc.MODES), help="a benchmarks/peers.py mode (its shape, 2 ranks)")
    ap.add_argument("--flags", default="", help="`isthmus train` flags (instead of --mode)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks for --flags (1: this process)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="timed steps (the median counts)")
    ap.add_argument("--profiled", type=int, default=3, help="profiled steps (their mean counts)")
    ap.add_argument("--top", type=int, default=12, help="ops listed per rank")
    ap.add_argument(
        "--free-tp-collectives",
        action="store_true",
        help="tensor parallelism's collectives as local work alone (a bound: the numbers are wrong)",
    )
    opts = ap.parse_args(argv)
    if bool(opts.mode) == bool(opts.flags):
        ap.error("give --mode or --flags (one of them)")
    if opts.mode:
        opts.nproc = pc.WORLD
    if opts.nproc < 1 or min(opts.steps, opts.profiled) < 1 or opts.warmup < 0:
        ap.error("--nproc, --steps and --profiled must be at least 1, --warmup at least 0")
    # ISTHMUS_MAX_STEPS (a smoke run, as the docs' commands run in the tests) caps every loop.
    opts.warmup, opts.steps, opts.profiled = capped(opts.warmup), capped(opts.steps), capped(opts.profiled)
    return opts


def main() -> None:
    opts = parse_args()
    what = f"--mode {opts.mode} (peers.py's debug shape)" if opts.mode else f"--flags {opts.flags!r}"
    what += f", {opts.nproc} rank(s), {opts.steps} timed and {opts.profiled} profiled step(s) after {opts.warmup}"
    what += ", tensor parallelism's collectives free (a bound)" if opts.free_tp_collectives else ""
    with tempfile.TemporaryDirectory() as root:
        if opts.mode:
            pc.random_tokens(1 << 20).tofile(f"{root}/tokens.bin")
        if opts.nproc == 1:
            report([profile_rank(0, opts, root)], what)
            return
        pc.spawn_ranks(_rank_main, (opts, root), opts.nproc)
        results = [json.loads(Path(root, f"rank{r}.json").read_text()) for r in range(opts.nproc)]
        report(results, what)


if __name__ == "__main__":
    main()
