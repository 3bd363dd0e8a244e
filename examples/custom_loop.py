"""Train the `tiny` Llama with your own loop: isthmus lays the model out, the loop stays plain torch.

    python examples/custom_loop.py                                   # one process
    torchrun --nproc-per-node 2 examples/custom_loop.py              # FSDP over 2 ranks
    torchrun --nproc-per-node 2 examples/custom_loop.py --tp 2       # tensor parallel
    torchrun --nproc-per-node 2 examples/custom_loop.py --dp-shard 2

The data are the bytes of a few Python standard-library modules (the tiny flavor's vocabulary is
256, a byte-level model), so nothing is downloaded. Rank 0 prints the loss, averaged over ranks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import textwrap
from pathlib import Path

import torch
import torch.distributed as dist

import isthmus
from isthmus.api import clip_grad_norm, shard_batch, step
from isthmus.models.flavors import get_flavor


def stdlib_bytes() -> torch.Tensor:
    """Token ids 0..255: the source of argparse, json, pathlib and textwrap."""
    files = [argparse.__file__, json.__file__, pathlib.__file__, textwrap.__file__]
    data = b"".join(Path(f).read_bytes() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def global_batch(tokens: torch.Tensor, batch: int, seq_len: int, step_i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same random windows on every rank (seeded by the step); inputs and next-token targets."""
    gen = torch.Generator().manual_seed(step_i)
    starts = torch.randint(len(tokens) - seq_len - 1, (batch,), generator=gen)
    windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp-shard", type=int, default=None, help="default: the ranks left after tp")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=8, help="global batch, over all data-parallel ranks")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    opt = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR, ...
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    dp_shard = opt.dp_shard or world // opt.tp
    # Any [parallel] key, by its config name (zero_stage, sequence_parallel, cp, pp, ...).
    layout = isthmus.LayoutSpec(dp_shard=dp_shard, tp=opt.tp, zero_stage=3)
    dims = layout.dims()

    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    mesh = dims.build_mesh(device.type) if world > 1 else None
    model = isthmus.build_model(get_flavor("tiny"), device="meta")  # no memory: parallelize allocates the shards
    pm = isthmus.parallelize(model, layout, mesh=mesh, device=device, seed=0, seq_len=opt.seq_len)
    # foreach=False: with tensor parallelism some parameters are DTensors and some plain tensors.
    optimizer = torch.optim.AdamW(pm.parameters(), lr=opt.lr, weight_decay=0.0, foreach=False)

    tokens = stdlib_bytes()
    dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
    for i in range(opt.steps):
        inputs, targets = global_batch(tokens, opt.batch_size, opt.seq_len, i)
        inputs, targets = inputs.chunk(dims.dp)[dp_rank], targets.chunk(dims.dp)[dp_rank]  # this rank's slice
        inputs, targets = shard_batch(pm, inputs.to(device), targets.to(device), mesh)
        loss = step(pm, inputs, targets)  # forward + backward, whatever the layout
        grad_norm = clip_grad_norm(pm, 1.0, mesh)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if world > 1:  # each rank's loss is over its own slice: average for the log line
            dist.all_reduce(loss)
            loss /= world
        if rank == 0:
            print(f"step {i + 1:3d}  loss {loss.item():.4f}  grad_norm {grad_norm:.3f}", flush=True)

    if world > 1:
        # Free the model, optimizer and mesh (and with them the DTensor specs holding the gloo groups)
        # while the interpreter is whole, and let no rank tear down while another still talks to it:
        # without this a rank now and then aborted at exit ("terminate called without an active
        # exception", 1 run in 12 here) after every step had finished.
        del pm, optimizer, mesh
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
