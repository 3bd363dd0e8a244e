"""Expert parallelism measured: the moe-small model at ep 2 against one process and a hand-written torch loop.

One shape (isthmus's `moe-small` flavor: dim 256, 4 layers, 8 routed SwiGLU experts of 256 plus one
shared, top-2, softmax router, aux-loss balancing), fp32, AdamW, clipping at 1.0, one global batch
of ``--batch`` sequences per step at each ``--seq-len`` (the operating points, taken in turn), the same seed and the same batches (uniform
random token ids from a seeded generator) for every system:

- ``one``: isthmus's real `Trainer` in one process, the whole batch, two intra-op threads (the
  machine's two cores);
- ``ep2``: the same `Trainer` on 2 gloo ranks of one thread, ``--parallel.nproc 2 --parallel.ep 2``
  (ep folds over dp_shard 2: each rank holds 4 of the 8 experts of every layer and half the batch,
  the dense part is FSDP-sharded over the two);
- ``torch``: the textbook torch loop of that shape on the same 2 ranks: `build_model` + `init_weights`,
  every MoE layer's experts cut by hand to the rank's 4 and reached through
  ``torch.distributed.nn.functional.all_to_all_single`` (counts first, then the token copies with
  uneven splits, the reverse all-to-all in backward: the dispatch torchtitan and Megatron write), the
  dense part under DistributedDataParallel with the expert weights left out of its all-reduce.
  torch ships no expert-parallel module, so this is what a torch user writes; DDP rather than
  fully_shard because a model this size fits every rank, which is when a torch user picks DDP.

Colossal-AI's MoE plugin (0.5.0's MoeHybridParallelPlugin) is not run, for three reasons read in
its source: it shards a model through shardformer policies written for transformers' Mixtral and
DeepSeek classes, not for isthmus's model (and Mixtral has no shared expert); ep 2 on 2 ranks leaves
no data-parallel group for the experts, which it refuses under its DDP (zero_stage 0) and so needs
its ZeRO optimizer; and its ZeRO asserts a CUDA device, as benchmarks/peers.py found for the dense
modes.

The systems take turns block by block, each round in another of the six orders of the three (the
2-rank pair and the one process wait, sleeping, while another system runs), so machine noise falls
on all of them alike. Printed: each system's tokens/s (median over rounds), the per-round ratios and their
median, and the all-to-all's share of an ep-2 step. That share is measured in extra steps after
the rounds, by timers around every all-to-all of the dispatch and combine (the token counts'
exchange included), forward and backward, each timer closed only once the collective has
completed on this rank (so it includes waiting for the other rank to arrive): for isthmus by
wrapping the collectives `isthmus.parallel.expert` calls, for the torch loop by wrapping
``torch.distributed.all_to_all_single``, which its dispatch calls.
``--plan`` also asks the planner's simulator for its ep all-to-all share of the same step on the
``local`` topology.

    python benchmarks/moe.py [--rounds 6] [--steps 3] [--warmup 1] [--batch 16] [--seq-len 128,256]
                             [--plan] [--out FILE] [--plot docs/img/moe.svg]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import peers_common as pc  # noqa: E402
from isthmus.parallel.rendezvous import LOOPBACK, loopback_store_server, served_store_environ  # noqa: E402
from isthmus.train.short_run import capped, max_steps_override  # noqa: E402

FLAVOR = "moe-small"
VOCAB = 256
EP = 2
SYSTEMS = ("one", "ep2", "torch")
NAMES = {"one": "isthmus, one process", "ep2": "isthmus ep 2", "torch": "hand-written torch ep 2"}
PAIR = ("ep2", "torch")  # the systems the 2-rank pair runs
ORDERS = list(itertools.permutations(SYSTEMS))


def round_order(r: int) -> tuple[str, ...]:
    """The systems' turns in round r: every order in turn, so each system runs first, between and
    last equally often over six rounds."""
    return ORDERS[r % len(ORDERS)]


# ---- timing the all-to-alls ----------------------------------------------------------------------


class A2ATimer:
    """Wall seconds inside all-to-alls (each one waited for before its timer stops), while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.seconds = 0.0
        self.calls = 0

    @contextmanager
    def timing(self) -> Iterator[None]:
        if not self.on:
            yield
            return
        t0 = time.perf_counter()
        yield
        self.seconds += time.perf_counter() - t0
        self.calls += 1


TIMER = A2ATimer()


def wrap_isthmus_collectives() -> None:
    """Replace the two collectives `isthmus.parallel.expert` calls by the same collectives, waited for
    at once and timed: the counts' ``all_to_all_single`` and the tokens' ``all_to_all_single_autograd``
    (forward, and the reverse all-to-all of its backward). Gloo on CPU overlaps nothing here (the
    results are used at once), so waiting at once changes no step's work."""
    from torch.distributed._functional_collectives import all_to_all_single

    import isthmus.parallel.expert as expert

    wait = torch.ops._c10d_functional.wait_tensor

    def timed_counts(x: torch.Tensor, out_splits: Any, in_splits: Any, group: Any) -> torch.Tensor:
        with TIMER.timing():
            return wait(all_to_all_single(x, out_splits, in_splits, group))

    class TimedA2A(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
            ctx.splits, ctx.group = (out_splits, in_splits), group
            with TIMER.timing():
                return wait(all_to_all_single(x, out_splits, in_splits, group))

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
            out_splits, in_splits = ctx.splits
            with TIMER.timing():
                return wait(all_to_all_single(grad.contiguous(), in_splits, out_splits, ctx.group)), None, None, None

    expert.all_to_all_single = timed_counts  # type: ignore[assignment]
    expert.all_to_all_single_autograd = TimedA2A.apply  # type: ignore[assignment]


def wrap_torch_collectives() -> None:
    """Time ``torch.distributed.all_to_all_single``, which the torch loop's counts exchange and
    ``torch.distributed.nn.functional.all_to_all_single`` (forward and backward) call; it returns
    once the collective is complete."""
    import torch.distributed as dist

    inner = dist.all_to_all_single

    def timed(*args: Any, **kwargs: Any) -> Any:
        with TIMER.timing():
            return inner(*args, **kwargs)

    dist.all_to_all_single = timed  # type: ignore[assignment]


# ---- the pair's worker: isthmus ep 2 and the hand-written torch loop ------------------------------


def key(system: str, seq_len: int) -> str:
    """A system at one operating point: a turn's name, a first loss's key."""
    return f"{system}@{seq_len}"


def isthmus_trainer(opts: argparse.Namespace, seq_len: int, layout: list[str]) -> Any:
    """The real trainer, built exactly as `isthmus train` builds it from these flags."""
    from isthmus.config import build_config, parse_overrides
    from isthmus.train.trainer import Trainer

    args = [
        *("--model.flavor", FLAVOR, "--data.path", f"{opts.root}/tokens.bin"),
        *("--train.batch_size", str(opts.batch), "--train.seq_len", str(seq_len)),
        *("--train.seed", str(pc.SEED), "--train.lr", str(pc.LR), "--train.grad_clip", str(pc.GRAD_CLIP)),
        *("--train.steps", "100000", "--train.val_every", "0", "--metrics.progress", "false"),
        *("--train.run_dir", f"{opts.root}/run-{opts.worker}-{seq_len}"),
        *layout,
    ]
    return Trainer(build_config(None, parse_overrides(args)))


def isthmus_step(trainer: Any) -> pc.Step:
    def step() -> float:
        return trainer.train_step()[0].loss

    return step


class HandExperts(torch.nn.Module):
    """This rank's slice of a layer's experts, reached by all-to-all: what a torch user writes for
    ``GroupedExperts.forward(x, counts)`` (x sorted by global expert, ``counts`` [n_experts])."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, ep: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = (torch.nn.Parameter(w.detach().clone()) for w in (w1, w2, w3))
        self.ep = ep

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        from torch.distributed.nn.functional import all_to_all_single

        n_local = self.w1.shape[0]
        received = torch.empty_like(counts)  # the counts first: both sides then know the split sizes
        dist.all_to_all_single(received, counts)
        by_source = received.view(self.ep, n_local)  # [source rank, local expert]
        send = counts.view(self.ep, n_local).sum(1).tolist()
        recv = by_source.sum(1).tolist()
        routed = all_to_all_single(x.new_empty(sum(recv), x.shape[1]), x, recv, send)
        # Rows arrive [source][local expert]: a stable sort by local expert groups them for the loop.
        local_expert = torch.arange(n_local).repeat(self.ep).repeat_interleave(by_source.flatten())
        order = local_expert.argsort(stable=True)
        splits = by_source.sum(0).tolist()
        outs = [
            (torch.nn.functional.silu(xe @ a.t()) * (xe @ c.t())) @ b.t()
            for xe, a, b, c in zip(routed[order].split(splits), self.w1, self.w2, self.w3, strict=True)
        ]
        out = torch.cat(outs)[order.argsort()]
        return all_to_all_single(x.new_empty(x.shape), out, send, recv)


def torch_step(trainer: Any, batch: int, seq_len: int) -> pc.Step:
    """The hand-written ep-2 loop on isthmus's model, init and batch order (see the module doc)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from isthmus.data.loader import BatchSampler
    from isthmus.models.llama import build_model, init_weights
    from isthmus.models.moe import MoE, aux_loss_term

    a = trainer.model_args
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(a, device="cpu")
    init_weights(model, pc.SEED, a)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    n_local = a.n_experts // world
    mine = slice(rank * n_local, (rank + 1) * n_local)
    for m in layers:
        m.experts = HandExperts(m.experts.w1[mine], m.experts.w2[mine], m.experts.w3[mine], world)
        m.counting = False  # nobody reads the load counts here
    expert_names = [n for n, _ in model.named_parameters() if ".experts." in n]
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    dense = [p for n, p in model.named_parameters() if ".experts." not in n and p.requires_grad]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_names)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=pc.LR, betas=(0.9, 0.95), weight_decay=0.1)
    sampler = BatchSampler(trainer.data.train, seq_len, pc.SEED)

    def step() -> float:
        x, y = sampler.next_batch(batch, rank, world)
        loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        aux = aux_loss_term(layers)
        (loss if aux is None else loss + aux).backward()
        # Each rank's loss is the mean over its own tokens and DDP averages the dense gradients; an
        # expert's gradient sums both ranks' tokens (the all-to-all's backward brings them): halve it.
        for p in experts:
            p.grad.div_(world)
        # The clipping norm: dense gradients are equal on both ranks, expert gradients are not.
        sq = torch.stack([torch.linalg.vector_norm(p.grad) ** 2 for p in experts]).sum()
        dist.all_reduce(sq)
        sq += torch.stack([torch.linalg.vector_norm(p.grad) ** 2 for p in dense]).sum()
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), pc.GRAD_CLIP, sq.sqrt())
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss := loss.detach())
        return float(loss) / world

    return step


def a2a_share(step: pc.Step, steps: int) -> dict[str, float]:
    """This rank's seconds in all-to-alls and in steps, over ``steps`` steps."""
    TIMER.seconds, TIMER.calls, TIMER.on = 0.0, 0, True
    torch.distributed.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.distributed.barrier()
    total = time.perf_counter() - t0
    TIMER.on = False
    return {"a2a_s": TIMER.seconds, "step_s": total, "calls": TIMER.calls / steps}


def pair_worker(rank: int, opts: argparse.Namespace) -> None:
    """One rank of the 2-rank pair: build isthmus ep 2 and the torch loop per operating point, then
    time them turn by turn."""
    import torch.distributed as dist

    pc.init_gloo(rank)
    na: dict[str, str] = {}
    first_loss: dict[str, float] = {}
    steps: dict[str, pc.Step] = {}
    for seq in opts.seq_len:
        layout = ["--parallel.nproc", "2", "--parallel.ep", str(EP), *shlex.split(opts.ep_flags)]
        trainer = isthmus_trainer(opts, seq, layout)
        builds = {"ep2": lambda: isthmus_step(trainer), "torch": lambda: torch_step(trainer, opts.batch, seq)}
        for system, build in builds.items():
            if (step := pc.probe(key(system, seq), build, first_loss, na)) is not None:
                steps[key(system, seq)] = step
    pc.report_ready(opts.root, "pair", na, first_loss)
    for r in range(opts.rounds):
        for seq in opts.seq_len:
            for k in (key(s, seq) for s in round_order(r) if s in PAIR):
                pc.wait_turn(opts.root, "pair", r, k)
                seconds = {k: pc.time_block(steps[k], opts.warmup, opts.steps)} if k in steps else {}
                if rank == 0:
                    pc.finish_turn(opts.root, "pair", r, k, seconds)
    # The all-to-all's share, in steps of their own after the rounds (the wrapped collectives wait at once).
    pc.wait_turn(opts.root, "pair", opts.rounds, "share")
    wrap_isthmus_collectives()
    wrap_torch_collectives()
    shares = {k: a2a_share(step, opts.share_steps) for k, step in steps.items()}
    gathered: list[dict | None] = [None] * pc.WORLD
    dist.all_gather_object(gathered, shares)
    if rank == 0:
        pc.finish_turn(opts.root, "pair", opts.rounds, "share", {"ranks": gathered})
    dist.barrier()
    dist.destroy_process_group()


def one_worker(opts: argparse.Namespace) -> None:
    """The one process: isthmus's trainer on the whole batch with both cores, timed in its turns."""
    na: dict[str, str] = {}
    first_loss: dict[str, float] = {}
    layout = ["--parallel.nproc", "1", "--train.threads", str(pc.WORLD)]
    steps: dict[str, pc.Step] = {}
    for seq in opts.seq_len:
        build = lambda: isthmus_step(isthmus_trainer(opts, seq, layout))  # noqa: E731
        if (step := pc.probe(key("one", seq), build, first_loss, na)) is not None:
            steps[key("one", seq)] = step
    pc.finish_turn(opts.root, "one", -1, "ready", {"na": na, "first_loss": first_loss})
    for r in range(opts.rounds):
        for k in (key("one", seq) for seq in opts.seq_len):
            pc.wait_turn(opts.root, "one", r, k)
            seconds = {}
            if k in steps:
                for _ in range(opts.warmup):
                    steps[k]()
                t0 = time.perf_counter()
                for _ in range(opts.steps):
                    steps[k]()
                seconds[k] = time.perf_counter() - t0
            pc.finish_turn(opts.root, "one", r, k, seconds)


# ---- the driver ----------------------------------------------------------------------------------


def launch(name: str, opts: argparse.Namespace, root: str, served: int) -> list[subprocess.Popen]:
    """Start the pair's two ranks (``name`` "pair") or the one process ("one"), logging to root/<name>.log."""
    world = pc.WORLD if name == "pair" else 1
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            **dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)),
            **dict(MASTER_ADDR=LOOPBACK, OMP_NUM_THREADS="1" if world > 1 else str(pc.WORLD)),
            **(served_store_environ(served) if world > 1 else {}),
            "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE)]),
        }
        cmd = [sys.executable, __file__, "--worker", name, "--rank", str(rank), "--root", root]
        cmd += ["--rounds", str(opts.rounds), "--steps", str(opts.steps), "--warmup", str(opts.warmup)]
        cmd += ["--batch", str(opts.batch), "--seq-len", ",".join(map(str, opts.seq_len))]
        cmd += ["--share-steps", str(opts.share_steps), f"--ep-flags={opts.ep_flags}"]
        log = (Path(root) / f"{name}.log").open("a")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def await_turn(root: str, name: str, r: int, what: str, procs: list[subprocess.Popen]) -> dict:
    """The turn's figures, or a RuntimeError naming the worker's last log line if a process died first."""
    while (res := pc.turn_result(root, name, r, what)) is None:
        if any(p.poll() not in (None, 0) for p in procs):
            lines = [ln for ln in (Path(root) / f"{name}.log").read_text().splitlines() if ln.strip()]
            raise RuntimeError(f"{name} died: {(lines[-1:] or ['(no output)'])[0][:160]}")
        time.sleep(pc.POLL_S)
    return res


def run_rounds(opts: argparse.Namespace, root: str) -> dict:
    """Start both workers, wait until both are built, hand out the turns; returns every figure."""
    seconds: dict[str, list[float]] = {key(s, seq): [] for seq in opts.seq_len for s in SYSTEMS}
    res: dict[str, Any] = {"seconds": seconds, "na": {}, "first_loss": {}, "share": None}
    with loopback_store_server() as served:
        procs = {name: launch(name, opts, root, served) for name in ("pair", "one")}
        try:
            for name in procs:
                ready = await_turn(root, name, -1, "ready", procs[name])
                res["na"].update(ready["na"])
                res["first_loss"].update(ready["first_loss"])
            for r in range(opts.rounds):
                for seq in opts.seq_len:
                    for system in round_order(r):
                        name, k = "pair" if system in PAIR else "one", key(system, seq)
                        pc.give_turn(root, name, r, k)
                        for got, t in await_turn(root, name, r, k, procs[name]).items():
                            seconds[got].append(t)
            pc.give_turn(root, "pair", opts.rounds, "share")
            res["share"] = await_turn(root, "pair", opts.rounds, "share", procs["pair"])["ranks"]
            for name, ps in procs.items():
                for p in ps:
                    if p.wait(timeout=120) != 0:
                        raise RuntimeError(f"{name} exited with {p.returncode} after its last turn")
        finally:
            for p in (p for ps in procs.values() for p in ps):
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return res


def planned_share(opts: argparse.Namespace, seq_len: int) -> str:
    """The simulator's ep all-to-all share of the same ep-2 step on the `local` topology (a cell)."""
    cmd = [sys.executable, "-m", "isthmus", "simulate", "--model.flavor", FLAVOR, "--topology", "local"]
    cmd += ["--gpus", "2", "--train.batch_size", str(opts.batch), "--train.seq_len", str(seq_len)]
    cmd += ["--parallel.dp_shard", "2", "--parallel.zero_stage", "3", "--parallel.ep", str(EP), "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        return f"n/a ({(res.stderr.strip().splitlines() or ['no output'])[-1][:160]})"
    sim = json.loads(res.stdout)
    step, ep = sim["step_time_s"], sim["breakdown_s"]["ep comm"]
    return f"{ep / step:.1%} ({ep * 1e3:.1f} of {step * 1e3:.0f} ms; {sim['tokens_per_s']:,.0f} tok/s)"


def rates(res: dict, opts: argparse.Namespace, k: str, seq_len: int) -> list[float]:
    """Tokens/s of each round (global tokens per second), or [] if a round is missing."""
    ts = res["seconds"][k]
    return [opts.batch * seq_len * opts.steps / t for t in ts] if len(ts) == opts.rounds else []


def ratio_cell(res: dict, opts: argparse.Namespace, a: str, b: str, seq_len: int) -> str:
    """Median of the per-round tokens/s ratios a / b, then the rounds'."""
    ra, rb = rates(res, opts, key(a, seq_len), seq_len), rates(res, opts, key(b, seq_len), seq_len)
    if not ra or not rb:
        return "-"
    ratios = [x / y for x, y in zip(ra, rb)]
    return f"{statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)})"


def report(res: dict, opts: argparse.Namespace) -> None:
    print(
        f"{FLAVOR}, fp32, global batch {opts.batch} sequences, {opts.rounds} round(s) x {opts.steps} timed "
        f"step(s) (+{opts.warmup} warm-up) per system; one process: 2 threads; ep 2: 2 gloo ranks x 1 thread"
    )
    print()
    print(
        "| seq_len | one process tok/s | isthmus ep 2 tok/s | torch ep 2 tok/s | ep 2 / one (rounds) "
        "| isthmus / torch ep 2 (rounds) | step-1 loss one / ep 2 / torch |"
    )
    print("|---|---:|---:|---:|---|---|---|")
    for seq in opts.seq_len:
        cells = []
        for s in SYSTEMS:
            r = rates(res, opts, key(s, seq), seq)
            cells.append(f"{statistics.median(r):,.0f}" if r else f"n/a ({res['na'].get(key(s, seq), 'no figure')})")
        cells += [ratio_cell(res, opts, "ep2", "one", seq), ratio_cell(res, opts, "ep2", "torch", seq)]
        losses = [res["first_loss"].get(key(s, seq)) for s in SYSTEMS]
        cells.append(" / ".join("-" if v is None else f"{v:.4f}" for v in losses))
        print(f"| {seq} | " + " | ".join(cells) + " |")
    if not res["share"]:
        return
    print()
    print(f"all-to-all share of an ep-2 step ({opts.share_steps} steps after the rounds; timers, wait included):")
    print()
    plan = " | planned (simulate, local)" if opts.plan else ""
    print(f"| seq_len | isthmus ep 2, rank 0 / 1 | torch ep 2, rank 0 / 1 | all-to-alls per step{plan} |")
    print("|---|---|---|---|" + ("---|" if opts.plan else ""))
    for seq in opts.seq_len:
        cells, calls = [], "-"
        for s in PAIR:
            per_rank = [r[key(s, seq)] for r in res["share"] if r and key(s, seq) in r]
            cells.append(" / ".join(f"{d['a2a_s'] / d['step_s']:.1%}" for d in per_rank) or "-")
            calls = f"{per_rank[0]['calls']:.0f}" if per_rank else calls
        cells.append(calls)
        if opts.plan:
            cells.append(planned_share(opts, seq))
        print(f"| {seq} | " + " | ".join(cells) + " |")


def plot(res: dict, opts: argparse.Namespace, path: str) -> None:
    """Bars per operating point: each system's median tokens/s over the rounds, the rounds as dots."""
    import plots

    plt = plots.pyplot()
    if plt is None:
        return
    colors = {"one": plots.COLORS["rest"], "ep2": plots.COLORS["isthmus"], "torch": plots.COLORS["torch"]}
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    width = 0.8 / len(SYSTEMS)
    for i, seq in enumerate(opts.seq_len):
        for j, s in enumerate(SYSTEMS):
            x = i + (j - (len(SYSTEMS) - 1) / 2) * width
            r = rates(res, opts, key(s, seq), seq)
            if r:
                ax.bar(x, statistics.median(r), width, color=colors[s], label=NAMES[s] if i == 0 else None)
                ax.plot([x] * len(r), r, "k.", markersize=2.5)
            else:
                ax.text(x, 0, "n/a", rotation=90, ha="center", va="bottom", fontsize=7, color="0.4")
    ax.set_xticks(range(len(opts.seq_len)), [f"{opts.batch} x {seq} tokens" for seq in opts.seq_len])
    ax.set_ylabel("tokens/s (bar: median; dots: rounds)")
    ax.set_title(f"{FLAVOR}, fp32, 2 cores, {opts.rounds} rounds x {opts.steps} steps", fontsize=9)
    ax.legend(fontsize=7, ncols=3, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    plots.save(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per system, operating point and round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before each timed block")
    ap.add_argument("--batch", type=int, default=16, help="global batch in sequences (even: split over 2 ranks)")
    ap.add_argument("--seq-len", default="128,256", help="comma-separated sequence lengths: the operating points")
    ap.add_argument("--ep-flags", default="", help="more isthmus flags for ep 2 (e.g. '--parallel.zero_stage 2')")
    ap.add_argument("--share-steps", type=int, default=10, help="steps the all-to-all share is timed over")
    ap.add_argument("--plan", action="store_true", help="also print the simulator's all-to-all share")
    ap.add_argument("--out", default="", help="also write every figure as JSON here")
    ap.add_argument("--plot", default="", help="also draw tokens/s per system to this file (.svg, .png)")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--root", default="", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    try:
        opts.seq_len = [int(x) for x in opts.seq_len.split(",") if x]
    except ValueError:
        ap.error(f"--seq-len {opts.seq_len}: must be comma-separated integers")
    if min(opts.rounds, opts.steps, opts.share_steps, *opts.seq_len, 1) < 1 or opts.warmup < 0 or not opts.seq_len:
        ap.error("--rounds, --steps, --share-steps and each --seq-len must be at least 1, --warmup at least 0")
    if opts.batch < 2 or opts.batch % pc.WORLD:
        ap.error(f"--batch {opts.batch}: must be a positive multiple of {pc.WORLD} (the ranks split it)")
    # ISTHMUS_MAX_STEPS (a smoke run, as the docs' commands run in the tests): one round of one step
    # at the first operating point, no warm-up (each system's build ran a step already).
    if max_steps_override() is not None and not opts.worker:
        opts.rounds, opts.steps, opts.warmup, opts.seq_len = 1, 1, 0, opts.seq_len[:1]
    opts.rounds, opts.steps, opts.warmup = capped(opts.rounds), capped(opts.steps), capped(opts.warmup)
    opts.share_steps = 1 if max_steps_override() is not None else opts.share_steps
    return opts


def main() -> None:
    opts = parse_args()
    if opts.worker == "pair":
        pair_worker(opts.rank, opts)
        return
    if opts.worker == "one":
        one_worker(opts)
        return
    if max_steps_override() is not None:
        print("ISTHMUS_MAX_STEPS: one round of one step at the first --seq-len; the figures mean nothing")
    with tempfile.TemporaryDirectory() as root:
        np.random.default_rng(pc.SEED).integers(0, VOCAB, size=1 << 20, dtype=np.uint16).tofile(f"{root}/tokens.bin")
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        try:
            res = run_rounds(opts, root)
        except RuntimeError as exc:
            for log in Path(root).glob("*.log"):
                print(f"---- {log.name}\n{log.read_text()[-3000:]}", file=sys.stderr)
            sys.exit(f"moe benchmark failed: {exc}")
        report(res, opts)
        load = f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
        print(f"\n{time.perf_counter() - t0:.0f} s; load average (1 min) {load}")
        if opts.plot:
            plot(res, opts, opts.plot)
        if opts.out:
            Path(opts.out).write_text(json.dumps({"opts": vars(opts), **res}, indent=1))


if __name__ == "__main__":
    main()
