"""Bytes each rank really holds under DDP and ZeRO-1/2/3, measured on the trainer's own model.

For every layout, N gloo ranks build `Trainer(cfg)` exactly as `isthmus train` would, run one
`train_step()`, and report this rank's parameter, gradient and AdamW-state bytes next to the
unsharded single-process total (fp32 parameters + gradients + two moments = 16 bytes/parameter).

    python benchmarks/zero_memory.py [--flavor small] [--worlds 2 4]
"""

from __future__ import annotations

import argparse
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from isthmus.launch.warm import START_METHOD, start_rank_server
from isthmus.parallel.rendezvous import LOOPBACK, loopback_store_server, served_group_args
from isthmus.train.short_run import capped

# (label, overrides given dp degree N): plain DDP is the baseline every ZeRO stage is read against.
LAYOUTS: list[tuple[str, Callable[[int], list[str]]]] = [
    ("ddp", lambda n: ["--parallel.dp_replicate", str(n)]),
    ("zero1", lambda n: ["--parallel.dp_shard", str(n), "--parallel.zero_stage", "1"]),
    ("zero2", lambda n: ["--parallel.dp_shard", str(n), "--parallel.zero_stage", "2"]),
    ("zero3", lambda n: ["--parallel.dp_shard", str(n), "--parallel.zero_stage", "3"]),
]


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes of this rank's part: a DTensor's local shard, else the whole tensor."""
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _gathered_bytes(module: nn.Module) -> int:
    """Full-size parameters FSDP2 has gathered right now: while a group is unsharded its module
    holds plain tensors in place of its sharded DTensors (which stay allocated next to them)."""
    from torch.distributed.tensor import DTensor

    return sum(p.numel() * p.element_size() for p in module.parameters() if not isinstance(p, DTensor))


def _watch_gathered(model: nn.Module, peak: list[int]) -> None:
    """Sample `_gathered_bytes` at the end of each FSDP group's forward (before it may reshard)
    and at the start of its backward (after it re-gathers), keeping the maximum in ``peak[0]``."""
    from torch.distributed.fsdp import FSDPModule

    def sample(*_: Any) -> None:
        peak[0] = max(peak[0], _gathered_bytes(model))

    def after_fsdp_forward(_: nn.Module, __: Any, out: Any) -> None:
        # Registered after FSDP's own hooks, so this gradient hook runs after its pre-backward unshard.
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: sample())

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.register_forward_hook(sample, prepend=True)
            m.register_forward_hook(after_fsdp_forward)


def rank_trainer(steps: int, run_dir: str, cache_dir: str, flags: list[str]) -> Any:
    """The `Trainer` one rank of these benchmarks builds, as ``isthmus train`` would with ``flags``:
    ``steps`` steps, one thread, no validation or progress bar, a slice of the default data."""
    from isthmus.config import build_config, parse_overrides
    from isthmus.train.trainer import Trainer

    args = [
        "--train.steps",
        str(steps),
        "--train.threads",
        "1",
        "--train.val_every",
        "0",
        "--data.max_bytes",
        "200000",
        "--metrics.progress",
        "false",
        "--train.run_dir",
        run_dir,
        "--data.cache_dir",
        cache_dir,
        "--parallel.nproc",
        os.environ["WORLD_SIZE"],
        *flags,
    ]
    return Trainer(build_config(None, parse_overrides(args)))


def _measure(overrides: list[str], run_dir: str, cache_dir: str) -> dict[str, int]:
    """One rank: the trainer's model and optimizer after one step, in bytes."""
    trainer = rank_trainer(1, run_dir, cache_dir, overrides)
    model = trainer.pm.model
    peak = [0]
    if trainer.pm.dp_kind == "fsdp":
        _watch_gathered(model, peak)
    # The trainer frees gradients right after the optimizer step: count them just before it.
    grads = [0]

    def count_grads(*_: Any) -> None:
        grads[0] = sum(_local_bytes(p.grad) for p in trainer.pm.parameters() if p.grad is not None)

    trainer.optimizer.register_step_pre_hook(count_grads)
    trainer.train_step()
    # ZeroRedundancyOptimizer wraps a local AdamW over this rank's partition; its `.optim.state`
    # is what this rank really holds.
    opt = getattr(trainer.optimizer, "optim", trainer.optimizer)
    state = sum(_local_bytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    rest = sum(_local_bytes(p) for p in trainer.pm.parameters())
    # DDP / ZeRO-1 hold the full parameters throughout; FSDP2 holds shards plus what it gathered.
    in_step = rest + peak[0] if trainer.pm.dp_kind == "fsdp" else rest
    # DDP (and ZeRO-1, which is DDP underneath) also keeps its all-reduce buckets, a copy of the
    # gradients unless gradient_as_bucket_view=True; DDP reports their sizes in bytes.
    buckets = 0
    if trainer.pm.dp_kind in ("ddp", "zero1"):
        sizes = str(model._get_ddp_logging_data().get("bucket_sizes", ""))
        buckets = sum(int(x) for x in sizes.replace(" ", "").split(",") if x)
    return {"params_rest": rest, "params_step": in_step, "grads": grads[0], "optim": state, "buckets": buckets}


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, out_dir: str) -> None:
    """Child process: torchrun-like environment, one thread, gloo; the result goes to a pickle file."""
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR=LOOPBACK,
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", **served_group_args(port, rank, world))
        result: Any = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - shown by the parent
        result = ("error", traceback.format_exc())
    # Write the result first: gloo teardown can abort a process that already finished its work.
    (Path(out_dir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` gloo ranks; each rank's return value, by rank. The ranks fork
    from one server that imported torch and the trainer once, for every world (isthmus.launch.warm)."""
    # The ranks' store is served here, bound before they start (`isthmus.parallel.rendezvous`).
    with tempfile.TemporaryDirectory() as out_dir, loopback_store_server() as port:
        ctx = mp.start_processes(
            _entry, args=(world, port, fn, args, out_dir), nprocs=world, join=False, start_method=START_METHOD
        )
        for proc in ctx.processes:  # exit codes are not trusted (see _entry); the result files are
            proc.join()
        files = [Path(out_dir) / f"rank{r}.pkl" for r in range(world)]
        for rank, (proc, f) in enumerate(zip(ctx.processes, files)):
            if not f.exists():
                raise RuntimeError(f"rank {rank} exited with code {proc.exitcode} before reporting a result")
        results = [pickle.loads(f.read_bytes()) for f in files]
    for rank, (status, value) in enumerate(results):
        if status == "error":
            raise RuntimeError(f"rank {rank} failed:\n{value}")
    return [value for _, value in results]


def unsharded_bytes(flavor: str) -> int:
    """One process, fp32: parameters + gradients + AdamW exp_avg + exp_avg_sq, 4 bytes each."""
    from isthmus.config import ModelConfig
    from isthmus.models.llama import build_model
    from isthmus.models.resolve import resolve_model_args

    args = resolve_model_args(ModelConfig(flavor=flavor), 256)  # the byte tokenizer's vocabulary
    n = sum(p.numel() for p in build_model(args, device="meta").parameters())
    return 4 * 4 * n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="small")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    opts = ap.parse_args()
    start_rank_server()  # imports for every rank of every world, beside the measuring below
    total = unsharded_bytes(opts.flavor)
    mib = 2**20
    rows: list[list[str]] = []
    with tempfile.TemporaryDirectory() as root:
        for world in opts.worlds:
            for label, overrides in LAYOUTS[: capped(len(LAYOUTS))]:  # ISTHMUS_MAX_STEPS: a smoke run
                ranks = run_ranks(
                    _measure,
                    world,
                    ["--model.flavor", opts.flavor, *overrides(world)],
                    f"{root}/{label}{world}",
                    f"{root}/cache",
                )
                for rank, r in enumerate(ranks):
                    held = r["params_rest"] + r["grads"] + r["optim"]
                    in_step = r["params_step"] + r["grads"] + r["optim"]
                    rows.append(
                        [str(world), label, str(rank)]
                        + [f"{r[k] / mib:.2f}" for k in ("params_rest", "params_step", "grads", "optim", "buckets")]
                        + [f"{held / mib:.2f}", f"{held / total:.3f}", f"{in_step / total:.3f}"]
                    )
    header = [
        "N",
        "layout",
        "rank",
        "params MiB (rest)",
        "params MiB (in step)",
        "grads MiB",
        "optim MiB",
        "DDP buckets MiB",
        "total MiB (rest)",
        "/ unsharded",
        "/ unsharded (in step)",
    ]
    from rich.console import Console
    from rich.table import Table

    table = Table(
        *header,
        title=f"{opts.flavor}: bytes per rank; unsharded single process = {total / mib:.2f} MiB "
        "(fp32 params + grads + 2 AdamW moments)",
    )
    for row in rows:
        table.add_row(*row)
    Console(width=200).print(table)
    print(
        "params (in step): at-rest shards + the largest full-size parameter set FSDP2 had gathered at any "
        "group's end of forward or start of backward (sampled by hooks); DDP/ZeRO-1 hold full parameters always.\n"
        "grads: local .grad bytes just before optimizer.step; optim: tensors in the (local) optimizer state "
        "after one step.\ntotal and ratios: params + grads + optim (DDP buckets not included)."
    )


if __name__ == "__main__":
    main()
