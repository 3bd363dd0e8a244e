"""What both sides of benchmarks/peers.py share: the shape, the batches, the turn protocol, the timing.

Imported by the project venv's worker (isthmus + hand-written torch) and by Colossal-AI's worker,
which runs in its own venv: so this file needs nothing but the standard library, numpy and torch.

Turns: the driver writes ``go-<system>-<round>-<mode>`` into the shared directory; both ranks of
that system's process pair wait for it (sleeping, so an idle pair leaves the cores to the other),
run their block, and rank 0 writes ``done-...`` with the measured seconds. Only one pair computes
at a time, so the pairs alternate at the process level, round by round.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

from isthmus.parallel.rendezvous import group_store_args, loopback_store_server, served_store_environ

# torchtitan's debug model: Llama, dim 256, 6 layers, 16 heads (16 KV heads), SwiGLU FFN 768,
# vocab 2048, untied head. isthmus names it the "debug" flavor.
SHAPE = {"dim": 256, "n_layers": 6, "n_heads": 16, "n_kv_heads": 16, "ffn_dim": 768, "vocab_size": 2048}
SEQ_LEN = 256
PER_RANK = 8  # sequences per rank and step: a data-parallel step's global batch is 16
SEED = 0
LR = 3e-3
GRAD_CLIP = 1.0
WORLD = 2
# (mode, isthmus --parallel.* flags); every mode runs on the same 2 ranks.
MODES: dict[str, list[str]] = {
    "ddp": ["--parallel.dp_replicate", "2"],
    "zero1": ["--parallel.dp_replicate", "1", "--parallel.dp_shard", "2", "--parallel.zero_stage", "1"],
    "zero2": ["--parallel.dp_replicate", "1", "--parallel.dp_shard", "2", "--parallel.zero_stage", "2"],
    "zero3": ["--parallel.dp_replicate", "1", "--parallel.dp_shard", "2", "--parallel.zero_stage", "3"],
    "tp": ["--parallel.dp_replicate", "1", "--parallel.tp", "2"],
    "tp_sp": ["--parallel.dp_replicate", "1", "--parallel.tp", "2", "--parallel.sequence_parallel", "true"],
    "pp": [
        "--parallel.dp_replicate",
        "1",
        "--parallel.pp",
        "2",
        "--parallel.pp_schedule",
        "1f1b",
        "--parallel.microbatches",
        "4",
    ],
    "cp": ["--parallel.dp_replicate", "1", "--parallel.cp", "2"],
}
DATA_PARALLEL = ("ddp", "zero1", "zero2", "zero3")
MICROBATCHES = 4
POLL_S = 0.02
# Step = one optimizer step of one system in one mode; it returns the step's loss (mean over the
# batch) where this rank knows it.
Step = Callable[[], float | None]


def global_batch(mode: str) -> int:
    """Sequences per step: 8 per rank when the ranks split the batch (DP, ZeRO), else one shared batch of 8."""
    return PER_RANK * WORLD if mode in DATA_PARALLEL else PER_RANK


def random_tokens(n: int, seed: int = SEED) -> np.ndarray:
    """Uniform token ids in [0, vocab) from a seeded generator: the throughput of a step does not depend
    on what the ids mean, and every system reads the same ones."""
    return np.random.default_rng(seed).integers(0, SHAPE["vocab_size"], size=n, dtype=np.uint16)


def init_gloo(rank: int, world: int = WORLD) -> None:
    """One thread per rank (2 ranks on 2 cores) and a gloo group over the env's rendezvous."""
    torch.set_num_threads(1)
    # The store the driver serves for this pair (`isthmus.parallel.rendezvous`), else env:// on MASTER_PORT.
    group = group_store_args(world, rank) or {"rank": rank, "world_size": world}
    torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=300), **group)


def spawn_ranks(fn: Callable[..., None], args: tuple, world: int) -> None:
    """Run ``fn(rank, *args)`` on ``world`` processes started here, each with RANK / WORLD_SIZE set
    and this process serving their store (``fn`` joins it with :func:`init_gloo`)."""
    with loopback_store_server() as port:
        os.environ.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), **served_store_environ(port))
        torch.multiprocessing.spawn(_ranked, args=(fn, args), nprocs=world)


def _ranked(rank: int, fn: Callable[..., None], args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    fn(rank, *args)


def _turn(root: str, kind: str, system: str, r: int, mode: str) -> Path:
    return Path(root) / f"{kind}-{system}-{r}-{mode}"


def wait_turn(root: str, system: str, r: int, mode: str) -> None:
    """Block (sleeping) until the driver gives ``system`` its turn for round r of ``mode``."""
    go = _turn(root, "go", system, r, mode)
    while not go.exists():
        time.sleep(POLL_S)


def finish_turn(root: str, system: str, r: int, mode: str, result: dict[str, object]) -> None:
    """Rank 0 hands the turn back with its figures (written then renamed: the driver never reads half a file)."""
    done = _turn(root, "done", system, r, mode)
    tmp = done.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, done)


def give_turn(root: str, system: str, r: int, mode: str) -> None:
    _turn(root, "go", system, r, mode).touch()


def turn_result(root: str, system: str, r: int, mode: str) -> dict[str, object] | None:
    done = _turn(root, "done", system, r, mode)
    return json.loads(done.read_text()) if done.exists() else None


def time_block(step: Step, warmup: int, steps: int) -> float:
    """Seconds for ``steps`` steps after ``warmup`` untimed ones (caches and allocator warm again after the
    other systems ran). Every step ends in collectives both ranks join, so rank 0's wall time is the step's."""
    for _ in range(warmup):
        step()
    torch.distributed.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.distributed.barrier()
    return time.perf_counter() - t0


def first_line(exc: BaseException) -> str:
    """The error as one short line, for an "n/a (reason)" cell."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text[:160]


def probe(key: str, build: Callable[[], Step], first_loss: dict[str, float], na: dict[str, str]) -> Step | None:
    """Build a system's step and run it once: its loss goes to ``first_loss``, a failure's line to ``na``.

    The failures met here are unsupported ops or devices, raised alike on both ranks before any
    collective of the step, so neither rank is left waiting."""
    try:
        step = build()
        loss = step()
    except Exception as exc:  # noqa: BLE001 - any failure makes the cell "n/a (reason)"
        traceback.print_exc()  # the whole story in the pair's log; the table keeps one line
        na[key] = first_line(exc)
        return None
    if loss is not None:
        first_loss[key] = loss
    return step


def report_ready(root: str, system: str, na: dict[str, str], first_loss: dict[str, float]) -> None:
    """After every mode is built: rank 0 tells the driver, with the first-step losses any rank saw
    (a pipeline's loss lives on its last stage)."""
    gathered: list[dict[str, float] | None] = [None] * WORLD
    torch.distributed.all_gather_object(gathered, first_loss)
    if torch.distributed.get_rank() == 0:
        merged = {k: v for d in gathered if d for k, v in d.items()}
        finish_turn(root, system, -1, "ready", {"na": na, "first_loss": merged})
