"""Checkpoint I/O of isthmus's `Checkpointer`: save (sync and async), verify, load, size on disk, and
the training time a save costs, for the `small` flavor.

The real `Trainer` is built as `isthmus train` builds it, in one process or (``--nproc 2``) on two
gloo ranks with dp_shard 2 (FSDP: each rank writes its own shard). Measured on rank 0, whose wall
time is the collective's:

- sync save: `Checkpointer.save` with ``async_save = false`` (DCP write with fsync, the manifest's
  sha256 of every file, the rename). The training loop waits for all of it.
- async save: how long `save` blocks the loop (DCP stages a copy of the state in memory) and how
  long until the checkpoint is committed (`wait`), while nothing else runs.
- verify / load: `find_resume` (rank 0 checks every file's size and sha256) and `Checkpointer.load`
  into the live state; `load_model_weights`, one process reading the whole model (what export does).
- lost per save: blocks of ``--every`` training steps, with one save at the block's start or none;
  the extra time of a block with a save. Async overlaps the write with the block's steps, on the
  same cores. The kinds of block take turns so that machine noise falls on all alike. Two views:
  the fastest block of each kind (what is left when no other process took the cores) and the
  median over rounds of each save block minus the no-save block next to it. With as many training
  threads as cores (the default), async has no idle core to write on.

    python benchmarks/checkpoint_io.py [--flavor small] [--nproc 1] [--threads 0] [--repeats 5] [--every 3] [--rounds 12]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from isthmus.parallel.rendezvous import LOOPBACK, loopback_store_server, served_group_args
from isthmus.train.short_run import capped

BLOCKS = ("none", "sync", "async")


def _trainer(opts: argparse.Namespace, root: str) -> Any:
    from isthmus.config import build_config, parse_overrides
    from isthmus.train.trainer import Trainer

    args = [
        "--model.flavor",
        opts.flavor,
        "--train.steps",
        "1000000",
        "--train.val_every",
        "0",
        "--data.max_bytes",
        "400000",
        "--metrics.progress",
        "false",
        "--train.run_dir",
        f"{root}/run",
        "--data.cache_dir",
        f"{root}/cache",
        "--checkpoint.every",
        "1000000",
        "--checkpoint.keep",
        "2",
        "--parallel.nproc",
        str(opts.nproc),
    ]
    if opts.nproc > 1:
        args += ["--parallel.dp_shard", str(opts.nproc)]
    args += ["--train.threads", str(opts.threads or (1 if opts.nproc > 1 else 0))]
    return Trainer(build_config(None, parse_overrides(args)))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _timed(fn: Any) -> float:
    _barrier()
    start = time.perf_counter()
    fn()
    _barrier()
    return time.perf_counter() - start


def measure(opts: argparse.Namespace, root: str) -> dict[str, Any]:
    """Every measurement, on this rank; rank 0's numbers are the ones reported."""
    from isthmus.checkpoint.state import load_model_weights

    trainer = _trainer(opts, root)
    ck, state = trainer.checkpointer, trainer.train_state
    rank = dist.get_rank() if dist.is_initialized() else 0
    for _ in range(2):  # warm-up: allocator, kernels, the optimizer's state exists
        trainer.train_step()
    r: dict[str, list[float]] = {k: [] for k in ("sync", "async_block", "async_total", "verify", "load", "weights")}

    def save(async_save: bool) -> None:
        ck.cfg.async_save = async_save
        ck.save(trainer.step, state)

    for _ in range(opts.repeats):
        trainer.train_step()
        r["sync"].append(_timed(lambda: save(False)))
        trainer.train_step()
        _barrier()
        start = time.perf_counter()
        save(True)
        r["async_block"].append(time.perf_counter() - start)
        ck.wait()
        _barrier()
        r["async_total"].append(time.perf_counter() - start)
        latest = ck.root / f"step-{trainer.step:06d}"
        ck.cfg.resume = str(latest)
        point: list[Any] = []
        r["verify"].append(_timed(lambda: point.append(ck.find_resume())))
        r["load"].append(_timed(lambda: ck.load(point[0], state)))
        if rank == 0:
            r["weights"].append(_timed_local(lambda: load_model_weights(latest)))
        _barrier()
    size = sum(f.stat().st_size for f in latest.iterdir()) if rank == 0 else 0
    files = len(list(latest.iterdir())) if rank == 0 else 0
    model_bytes = sum(t.numel() * t.element_size() for t in load_model_weights(latest).values()) if rank == 0 else 0

    # Training time lost to a save: blocks of `every` steps, with a save at the start or none.
    blocks: dict[str, list[float]] = {k: [] for k in BLOCKS}
    step_times: list[float] = []
    for i in range(opts.rounds):
        order = BLOCKS if i % 2 == 0 else tuple(reversed(BLOCKS))
        for kind in order:
            _barrier()
            start = time.perf_counter()
            if kind != "none":
                save(kind == "async")
            for _ in range(opts.every):
                t0 = time.perf_counter()
                trainer.train_step()
                step_times.append(time.perf_counter() - t0)
            ck.wait()  # a save not done by the block's end costs the loop its remainder
            _barrier()
            blocks[kind].append(time.perf_counter() - start)
    return {
        "times": r,
        "size": size,
        "files": files,
        "model_bytes": model_bytes,
        "blocks": blocks,
        "step_times": step_times,
    }


def _timed_local(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _rank(rank: int, opts: argparse.Namespace, port: int, root: str, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(opts.nproc),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(opts.nproc),
        MASTER_ADDR=LOOPBACK,
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(opts.threads or 1)  # ranks share the cores
    dist.init_process_group("gloo", **served_group_args(port, rank, opts.nproc))
    result = measure(opts, root)
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="small")
    ap.add_argument("--nproc", type=int, default=1, help="1 process, or N gloo ranks with dp_shard N")
    ap.add_argument("--repeats", type=int, default=5, help="saves and loads timed of each kind")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: the cores / 1 per rank)")
    ap.add_argument("--every", type=int, default=3, help="training steps per block (a save every N steps)")
    ap.add_argument("--rounds", type=int, default=12, help="rounds of one block of each kind (none, sync, async)")
    opts = ap.parse_args()
    # ISTHMUS_MAX_STEPS (a smoke run, as the docs' commands run in the tests) caps every loop.
    opts.rounds = capped(opts.rounds)
    opts.repeats = capped(opts.repeats)
    opts.every = capped(opts.every)
    root = tempfile.mkdtemp(prefix="isthmus-ckpt-bench-")
    load_before = os.getloadavg()[0]
    try:
        if opts.nproc == 1:
            res = measure(opts, root)
        else:
            out = f"{root}/result.pt"
            with loopback_store_server() as port:  # bound before the ranks start (`isthmus.parallel.rendezvous`)
                mp.start_processes(_rank, args=(opts, port, root, out), nprocs=opts.nproc, start_method="spawn")
            res = torch.load(out, weights_only=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # On a shared machine other processes take the cores: the load average says how much.
    res["load"] = (load_before, os.getloadavg()[0])
    _report(opts, res)


def _report(opts: argparse.Namespace, res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t, mb = res["times"], res["size"] / 1e6
    med = {k: statistics.median(v) for k, v in t.items()}
    threads = opts.threads or (torch.get_num_threads() if opts.nproc == 1 else 1)
    layout = (
        f"1 process x {threads} thread(s)"
        if opts.nproc == 1
        else f"{opts.nproc} gloo ranks x {threads} thread(s), dp_shard {opts.nproc} (FSDP)"
    )
    table = Table(
        "operation",
        "median s",
        "min s",
        "max s",
        "MB/s",
        title=f"{opts.flavor}, {layout}: "
        f"checkpoint {mb:.1f} MB in {res['files']} files (model {res['model_bytes'] / 1e6:.1f} MB), "
        f"{opts.repeats} repeats",
    )
    rows = [
        ("sync save (loop blocked)", "sync"),
        ("async save: loop blocked", "async_block"),
        ("async save: until committed", "async_total"),
        ("verify (sha256 of every file)", "verify"),
        ("load into the training state", "load"),
        ("load_model_weights (1 process)", "weights"),
    ]
    for label, key in rows:
        ts = t[key]
        rate = (res["model_bytes"] if key == "weights" else res["size"]) / 1e6 / med[key]
        table.add_row(label, f"{med[key]:.3f}", f"{min(ts):.3f}", f"{max(ts):.3f}", f"{rate:.0f}")
    console = Console(width=160)
    console.print(table)

    blocks = res["blocks"]
    fast = {k: min(v) for k, v in blocks.items()}
    # Paired by round: a block with a save against the no-save block next to it in time.
    paired = {k: statistics.median(b - n for b, n in zip(v, blocks["none"], strict=True)) for k, v in blocks.items()}
    lost = Table(
        f"a save every {opts.every} steps",
        "block s: fastest",
        "lost per save s: fastest / paired median",
        "steps/s (fastest block)",
        "training time lost: fastest / paired",
        title=f"training time lost to a save: {opts.rounds} rounds of one block of {opts.every} steps of each kind "
        f"(fastest step {min(res['step_times']):.3f} s, median {statistics.median(res['step_times']):.3f} s)",
    )
    for kind in BLOCKS:
        saves = kind != "none"
        lost.add_row(
            f"{kind} save" if saves else "no save",
            f"{fast[kind]:.3f}",
            f"{fast[kind] - fast['none']:.3f} / {paired[kind]:.3f}" if saves else "-",
            f"{opts.every / fast[kind]:.2f}",
            f"{100 * (fast[kind] - fast['none']) / fast['none']:+.1f}% / "
            f"{100 * paired[kind] / statistics.median(blocks['none']):+.1f}%"
            if saves
            else "-",
        )
    console.print(lost)
    print(f"1-minute load average {res['load'][0]:.1f} before, {res['load'][1]:.1f} after, on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
