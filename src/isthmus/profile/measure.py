"""What `isthmus profile` measures on this machine, and the fits that turn it into a topology file.

    isthmus profile --out local-profile.toml --seconds 20
    isthmus plan --model.flavor small --topology local-profile.toml --train.batch_size 16 --train.seq_len 128

What it measures, as one rank sees it (torch on CPU, fp32), at the shapes of one model (``--model``,
``--batch``, ``--seq-len``; default the ``small`` flavor at 16 x 128, what ``isthmus train`` runs):

- every matmul of that model's blocks and head in its three training forms (forward, input and
  weight gradient) on one thread, caches flushed before each as the work between a model's matmuls
  leaves them; the planner's GEMM curve is fitted to them (``gemm_max_fraction``,
  ``gemm_half_dim`` against the kind's peak);
- the fixed cost of a small op forward and backward through autograd -> ``kernel_launch_us``;
- one real block (isthmus.models.llama) forward + backward, on one thread and on ``--threads``:
  the memory bandwidth is set so the planner's block time is the measured one (what the planner
  does not count as GEMM, norms, rotary embeddings, the CPU attention kernel, lands there), and
  the threads' speed-up scales the ``-<t>t`` kind;
- gloo all-reduce between 2 local ranks over loopback (two forked ranks, one thread each,
  4 KB to 64 MB), fitted to the planner's alpha-beta form t = 2 latency + bytes / bandwidth;
- the CPU peak that MFU divides by (isthmus.profile.device), on 1 and on ``--threads`` threads, fp32
  and bf16: this machine's entries of the peak cache are rewritten with the new figures;
- whole training steps of the model with 1 and with 3 blocks on those 2 ranks under tp, tp + sp,
  ZeRO-2 and ZeRO-3 (isthmus.api, as the trainer lays them out): what one block costs beyond the
  planner's count of the same steps is the runtime's own work per block (DTensor's dispatch, FSDP2's
  hooks and copies; Galvatron profiles each strategy's layer for the same reason) and becomes the
  kind's ``tp_block_us``, ``sp_block_us`` and ``shard_block_us``.

It writes a topology in the format of ``topologies/local.toml``: a ``[devices.cpu-local]`` kind
(one rank, one thread), ``[devices.cpu-local-<t>t]`` (one rank with t threads, which
``isthmus.planner.autoplan.local_topology`` uses when fewer ranks than cores run), and one node of
``cores`` devices joined by the measured gloo link. `isthmus.cli.profile` is the command.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import socket
import statistics
import tempfile
import time
import tomllib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from isthmus.api import clip_grad_norm, parallelize, shard_batch, step
from isthmus.config import TrainConfig
from isthmus.launch.warm import run_quietly_as_rank
from isthmus.layout.dims import ParallelDims
from isthmus.layout.spec import LayoutSpec
from isthmus.models.flavors import get_flavor
from isthmus.models.llama import build_model, init_weights
from isthmus.parallel.rendezvous import loopback_store_server, served_group_args
from isthmus.planner.autoplan import local_runtime
from isthmus.planner.compute import BlockShape, layer_times
from isthmus.planner.cost import estimate
from isthmus.planner.topology import device_kinds, parse_topology
from isthmus.planner.workload import RUNTIMES, Workload
from isthmus.train.optim import build_optimizer

ALLREDUCE_BYTES = tuple(4 * 1024 * 4**i for i in range(8))
"""4 KB, 16 KB, ... 64 MB."""
NOISE_SHARE = 0.02
"""A figure derived as the difference of two timings is resolved only when it is at least this
share of the larger timing: repeated best-of timings of the same work on a quiet machine still
differ by a percent or so, and a difference below that is noise."""
TIMER_S = time.get_clock_info("perf_counter").resolution
"""The timer's resolution: a difference below a few ticks was not measured."""


def resolved(difference: float, timing: float) -> float | None:
    """``difference`` (seconds: the difference of two timings, the larger ``timing``) when the timings
    resolve it, None when not: negative, or below :data:`NOISE_SHARE` of ``timing`` or 4 timer ticks.
    The profile writes no figure derived from an unresolved one (it keeps the base kind's value)."""
    floor = max(NOISE_SHARE * abs(timing), 4 * TIMER_S)
    return difference if difference >= floor else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b when both are resolved figures (b > 0), else None."""
    return a / b if a is not None and b is not None and b > 0 else None


# --- measurements -------------------------------------------------------------------------------------


def best_time(fn: Any, budget: float, min_reps: int = 2) -> float:
    """Best of repeated calls within ``budget`` seconds (at least ``min_reps``, after one warm-up)."""
    fn()
    best, reps, start = math.inf, 0, time.perf_counter()
    while reps < min_reps or time.perf_counter() - start < budget:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        reps += 1
        if reps >= 1000:
            break
    return best


def measure_op_overhead(budget: float) -> float:
    """Seconds per kernel of a tiny op's forward and backward through autograd (dispatch, not data)."""

    x = torch.ones(8, requires_grad=True)

    def step() -> None:
        y = x
        for _ in range(20):
            y = y * 1.0001
        y.sum().backward()

    # 20 multiplies forward, 20 backward (plus sum and its backward): ~42 kernels.
    return best_time(step, budget) / 42


def fit_gemm_curve(samples: list[tuple[int, int, int, float]], peak: float) -> tuple[float, float, float]:
    """(gemm_max_fraction, gemm_half_dim, rms relative error) of the planner's curve to ``samples``."""
    best = (math.inf, 0.0, 0.0)
    for i in range(1, 400):
        d0 = i * 0.5
        shape = [(m / (m + d0)) * (n / (n + d0)) * (k / (k + d0)) for m, n, k, _ in samples]
        obs = [f / peak for *_, f in samples]
        # Least squares on the log: log f = log obs - log shape, averaged.
        logf = sum(math.log(o / s) for o, s in zip(obs, shape)) / len(obs)
        frac = math.exp(logf)
        err = math.sqrt(sum((frac * s / o - 1) ** 2 for o, s in zip(obs, shape)) / len(obs))
        if err < best[0]:
            best = (err, frac, d0)
    err, frac, d0 = best
    return min(frac, 1.0), d0, err


def _gloo_worker(
    rank: int, port: int, sizes: list[int], budget: float, out: str, block: list[Any] | None = None, repeats: int = 3
) -> None:
    """One of the two ranks of :func:`measure_gloo` (a process of its own). ``block``:
    [flavor, batch, seq, seconds] to time a block while the other rank does the same."""

    from isthmus.parallel.shm_collectives import SharedMemoryCollectives, build_collectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", **served_group_args(port, rank, 2))
    # gloo's all-reduce (what data parallelism uses), then the shared-memory one tensor parallelism
    # uses between ranks of one host, where it serves (`isthmus.parallel.shm_collectives`); half the budget each.
    times = [_median_all_reduce(dist.all_reduce, nbytes, budget / 2 / len(sizes), repeats) for nbytes in sizes]
    world = dist.group.WORLD
    assert world is not None, "the default group was made above"
    host = build_collectives(world, timeout_s=120)
    host_times = None
    if isinstance(host, SharedMemoryCollectives):
        host_times = [_median_all_reduce(host.all_reduce, nbytes, budget / 2 / len(sizes), repeats) for nbytes in sizes]
    together: float | None = 0.0
    alone: float | None = 0.0
    if block:
        flavor, batch, seq, seconds = block
        steps = _block_steps(get_flavor(flavor), batch, seq)
        # Rank 0 alone (rank 1 waits), then both at once, in turns: the ratio is what a rank loses
        # to another rank computing beside it, and a noisy stretch falls on both sides alike.
        best = {"alone": [math.inf, math.inf], "together": [math.inf, math.inf]}
        go = torch.tensor([1])
        start = time.perf_counter()
        for i in range(50):
            for mode in ("alone", "together"):
                for j, fn in enumerate(steps):
                    dist.barrier()
                    if mode == "together" or rank == 0:
                        t = time.perf_counter()
                        fn()
                        best[mode][j] = min(best[mode][j], time.perf_counter() - t)
                    dist.barrier()
            go[0] = int(time.perf_counter() - start < seconds or i < 2)
            dist.broadcast(go, src=0)
            if not int(go[0]):
                break
        alone, together = block_from(best["alone"])[0], block_from(best["together"])[0]
    if rank == 0:
        got = {"allreduce": times, "host_allreduce": host_times, "block_alone": alone, "block_together": together}
        Path(out).write_text(json.dumps(got))
    dist.destroy_process_group()


def _median_all_reduce(all_reduce: Callable[[torch.Tensor], Any], nbytes: int, budget: float, repeats: int) -> float:
    """Median seconds of ``all_reduce`` of ``nbytes`` between the two ranks (a barrier before each)."""
    x = torch.ones(nbytes // 4)
    for _ in range(2):
        all_reduce(x)
    t = time.perf_counter()
    all_reduce(x)
    # Both ranks must run the same collectives: rank 0 decides how many repeats fit the budget.
    reps = torch.tensor([max(repeats, min(200, int(budget / max(time.perf_counter() - t, 1e-6))))])
    dist.broadcast(reps, src=0)
    samples = []
    for _ in range(int(reps)):
        dist.barrier()
        t = time.perf_counter()
        all_reduce(x)
        samples.append(time.perf_counter() - t)
    samples.sort()
    return samples[len(samples) // 2]


def measure_gloo(
    budget: float, sizes: tuple[int, ...] = ALLREDUCE_BYTES, block: list[Any] | None = None, repeats: int = 3
) -> tuple[list[tuple[int, float]], float | None, list[tuple[int, float]] | None]:
    """((bytes, median seconds) of a gloo all-reduce between two local ranks over loopback; when
    ``block`` asks, how much slower a block runs with both ranks computing than with one alone (None:
    not asked, or unresolved); the
    same (bytes, seconds) through shared memory, None where that path does not serve here)."""
    got = _two_ranks(
        _gloo_worker,
        lambda port, out: [port, list(sizes), budget, out, block, repeats],
        120 + 10 * budget,
        "the gloo ranks",
    )
    shared = ratio(got["block_together"], got["block_alone"])
    host = list(zip(sizes, got["host_allreduce"])) if got["host_allreduce"] is not None else None
    return list(zip(sizes, got["allreduce"])), shared, host


MECHANISMS: dict[str, dict[str, Any]] = {
    "tp": {"tp": 2},
    "sp": {"tp": 2, "sequence_parallel": True},
    "zero2": {"dp_shard": 2, "zero_stage": 2},
    "zero3": {"dp_shard": 2, "zero_stage": 3},
}
"""The 2-rank layouts whose runtime work :func:`measure_mechanisms` times (``LayoutSpec`` fields)."""

SHARD_EVENTS = {2: 2, 3: 3}
"""FSDP2 collectives per block and step with one microbatch: ZeRO-2 gathers once and
reduce-scatters once; ZeRO-3 gathers again for the backward."""


def _mechanism_worker(
    rank: int, port: int, flavor: str, batch: int, seq: int, steps: int, out: str, warmup: int = 2
) -> None:
    """One of the two ranks of :func:`measure_mechanisms` (a process of its own, one thread, gloo):
    the median time of a whole training step (forward, backward, clipping, AdamW) of ``flavor``
    with 1 and with 3 blocks under each of :data:`MECHANISMS`, as isthmus.api lays it out."""

    torch.set_num_threads(1)
    dist.init_process_group("gloo", **served_group_args(port, rank, 2))
    args = get_flavor(flavor)
    times: dict[str, list[float]] = {}
    for name, values in MECHANISMS.items():
        spec = LayoutSpec(**values)
        dims = ParallelDims(dp_replicate=1, dp_shard=spec.dp_shard, cp=1, tp=spec.tp, pp=1, world_size=2)
        mesh = dims.build_mesh("cpu")
        dp = dims.dp
        times[name] = []
        for layers in (1, 3):
            a = replace(args, n_layers=layers)
            pm = parallelize(build_model(a, device="meta"), spec, mesh=mesh, device="cpu", seq_len=seq)
            opt = build_optimizer(pm.modules, TrainConfig(lr=1e-4))  # the trainer's own AdamW
            gen = torch.Generator().manual_seed(0)
            x = torch.randint(0, a.vocab_size, (batch, seq + 1), generator=gen)
            local = x.chunk(dp)[mesh["dp"].get_local_rank()] if dp > 1 else x
            inputs, targets = shard_batch(pm, local[:, :-1], local[:, 1:], mesh)
            samples = []
            for i in range(steps + warmup):
                dist.barrier()
                t = time.perf_counter()
                step(pm, inputs, targets)
                clip_grad_norm(pm, 1.0, mesh)
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i >= warmup:  # the first steps allocate and warm caches
                    samples.append(time.perf_counter() - t)
            times[name].append(statistics.median(samples))
            del pm, opt
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def measure_mechanisms(flavor: str, batch: int, seq: int, budget: float, repeats: int = 3) -> dict[str, list[float]]:
    """Per mechanism, the median training-step seconds of ``flavor`` with 1 and with 3 blocks on 2
    local ranks (two processes, as :func:`measure_gloo`)."""

    # As many steps as the budget allows, from the cpu kind's guess at one 3-block step.
    a = get_flavor(flavor)
    t = layer_times(device_kinds()["cpu"], BlockShape(a, batch, seq, dtype="fp32"), RUNTIMES["isthmus"])
    guess = 4 * (t.fwd + t.bwd + t.wgrad)
    steps = max(repeats, min(12, int(budget / (len(MECHANISMS) * 2 * 2 * max(guess, 1e-3)))))
    return _two_ranks(
        _mechanism_worker,
        lambda port, out: [port, flavor, batch, seq, steps, out, min(2, repeats)],
        300 + 10 * budget,
        "the 2-rank layouts",
    )


def _two_ranks(worker: Callable[..., None], worker_args: Any, timeout_s: float, what: str) -> Any:
    """Run ``worker(rank, *worker_args(port, out))`` on two ranks and return the JSON rank 0 wrote to
    ``out``. The ranks are forks of this process's forkserver (`isthmus.launch.warm`; `isthmus
    profile` starts it with this module preloaded): the gloo pair and the mechanisms' pair start
    without importing torch again; each worker sets its one thread itself."""

    ctx = multiprocessing.get_context("forkserver")  # the server `isthmus profile` started
    # The pair's store is served here, bound before they start (`isthmus.parallel.rendezvous`).
    with tempfile.TemporaryDirectory() as tmp, loopback_store_server() as port:
        out = os.path.join(tmp, "result.json")
        procs = [
            ctx.Process(target=run_quietly_as_rank, args=(worker, rank, *worker_args(port, out))) for rank in range(2)
        ]
        deadline = time.monotonic() + timeout_s
        try:  # (a Ctrl-C while they start kills those started, before their store goes)
            for p in procs:
                p.start()
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        codes = [p.exitcode for p in procs]
        if any(codes) or not os.path.exists(out):
            raise RuntimeError(f"{what} of isthmus profile failed (exit codes {codes})")
        return json.loads(Path(out).read_text())


def fit_mechanisms(
    topology_text: str, flavor: str, batch: int, seq: int, measured: dict[str, list[float]]
) -> dict[str, float | None]:
    """Seconds per block of runtime work each mechanism adds beyond what the planner counts.

    For each layout the planner predicts the same 2-rank steps on the profiled topology; the
    measured minus the predicted growth from 1 to 3 blocks, halved, is what one block adds: for tp
    per pass (forward, backward: DTensor's dispatch, the collectives' copies), for sequence
    parallelism on top of that, for FSDP2 per collective of a block (its hooks, copy-in and
    copy-out), least squares over ZeRO-2 (2 per step) and ZeRO-3 (3). A figure the steps do not
    resolve (:func:`resolved`) is None.
    """

    topo = parse_topology(tomllib.loads(topology_text))
    runtime = local_runtime()
    args = get_flavor(flavor)

    def excess(name: str) -> float:
        """Seconds the 2 blocks more add beyond the planner's count: a difference of two timings."""
        v = MECHANISMS[name]
        lay = LayoutSpec(**v, micro_batch=batch // v.get("dp_shard", 1), microbatches=1)
        pred = [
            estimate(Workload(replace(args, n_layers=n), batch, seq, "fp32"), topo.subset(2), lay, runtime).step_time_s
            for n in (1, 3)
        ]
        got = measured[name]
        return (got[1] - got[0]) - (pred[1] - pred[0])

    # Each figure comes from a difference of timings of steps of 1 and 3 blocks; one the steps do
    # not resolve (or a negative one) is None, and the topology keeps the kind's own value for it.
    def step(name: str) -> float:
        return measured[name][1]

    tp_excess = resolved(excess("tp"), step("tp"))
    tp = None if tp_excess is None else tp_excess / 4  # 2 blocks, 2 passes each
    sp_excess = excess("sp") - excess("tp")
    # Sequence parallelism may cost less than plain tp (a negative sp_block_us), but not below -tp.
    sp = (
        sp_excess / 4 if tp is not None and abs(sp_excess) >= NOISE_SHARE * step("sp") and sp_excess / 4 > -tp else None
    )
    z = [(SHARD_EVENTS[2], excess("zero2") / 2), (SHARD_EVENTS[3], excess("zero3") / 2)]
    fit = sum(e * r for e, r in z) / sum(e * e for e, _ in z)
    # At ZeRO-3 the 2 blocks more add 2 x 3 collectives' worth: what the steps must resolve.
    shard = fit if resolved(2 * SHARD_EVENTS[3] * fit, step("zero3")) is not None else None
    return {"tp_block_s": tp, "sp_block_s": sp, "shard_block_s": shard}


def fit_alpha_beta(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(latency, bandwidth) with t = 2 latency + bytes / bandwidth (``comm.all_reduce`` for 2 ranks),
    by least squares on the relative error so small and large messages weigh alike."""
    # Minimise sum ((a + b x) / t - 1)^2: normal equations in (a, b) with weights 1/t^2.
    s_aa = sum(1 / t**2 for _, t in samples)
    s_ab = sum(x / t**2 for x, t in samples)
    s_bb = sum(x * x / t**2 for x, t in samples)
    r_a = sum(1 / t for _, t in samples)
    r_b = sum(x / t for x, t in samples)
    det = s_aa * s_bb - s_ab**2
    a = (r_a * s_bb - r_b * s_ab) / det
    b = (s_aa * r_b - s_ab * r_a) / det
    t0, (x1, t1) = min(samples)[1], max(samples)
    if b * x1 < 0.1 * t1:
        # On a loaded machine, scheduling delays of tens of ms can drown even the largest message's
        # bytes, and the fit tilts to a per-byte time near zero: an absurd bandwidth. The
        # measurement did not resolve the bandwidth, so take what it does show: the smallest
        # message's time as the latency, the largest one's throughput as the bandwidth (a lower bound).
        a, b = t0, t1 / x1
    a, b = max(a, 1e-6), max(b, 1e-12)
    return a / 2, 1 / b


def model_gemms(args: Any, tokens_list: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(m, n, k) of every matmul of one training step of a block and the head at each token count:
    each Linear of isthmus.models.llama forward (m, n, k), input gradient (m, k, n), weight gradient
    (n, k, m), as autograd runs them."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    linears = [
        (q, args.dim),
        (kv, args.dim),
        (args.dim, q),
        (args.ffn_dim, args.dim),
        (args.dim, args.ffn_dim),
        (args.vocab_size, args.dim),
    ]
    if args.mlp == "gelu":
        linears.remove((args.ffn_dim, args.dim))
        linears.append((args.ffn_dim, args.dim))
    return sorted({s for t in tokens_list for n, k in linears for s in ((t, n, k), (t, k, n), (n, k, t))})


def measure_gemms(shapes: list[tuple[int, int, int]], budget: float) -> list[tuple[int, int, int, float]]:
    """(m, n, k, FLOP/s) of each matmul on one thread, caches flushed before each call as the
    elementwise work between a model's matmuls leaves them (best of repeats: noise only adds)."""

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    flush = torch.zeros(8 * 1024 * 1024)  # 32 MB, more than the last-level cache a core sees
    try:
        out = []
        for m, n, k in shapes:
            a, b = torch.randn(m, k), torch.randn(k, n)

            def call() -> None:
                flush.add_(1.0)
                t = time.perf_counter()
                a @ b
                best[0] = min(best[0], time.perf_counter() - t)

            best = [math.inf]
            best_time(call, budget / len(shapes))
            out.append((m, n, k, 2 * m * n * k / best[0]))
        return out
    finally:
        torch.set_num_threads(old)


def _block_steps(args: Any, batch: int, seq: int) -> list[Any]:
    """Forward + backward of the model with 1 and with 3 blocks, each a callable (warmed up once)."""

    x = torch.randint(0, args.vocab_size, (batch, seq))
    steps = []
    for layers in (1, 3):
        a = replace(args, n_layers=layers)
        model = build_model(a, device="cpu")
        init_weights(model, 0, a)

        def step(model: Any = model) -> None:
            loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten(0, 1))
            loss.backward()
            model.zero_grad(set_to_none=True)

        step()
        steps.append(step)
    return steps


def block_from(best: list[float]) -> tuple[float | None, float]:
    """(block, rest) from the best 1-block and 3-block times: the difference, halved, is one block
    (None when the timings do not resolve it, :func:`resolved`); the rest is the 1-block time less it."""
    diff = resolved(best[1] - best[0], best[1])
    block = None if diff is None else diff / 2
    return block, max(best[0] - (block or 0.0), 0.0)


def measure_block(
    args: Any, batch: int, seq: int, threads: tuple[int, ...], budget: float, repeats: int = 3
) -> dict[int, tuple[float | None, float]]:
    """Per thread count, (one block's forward + backward, the rest of the model's) seconds at
    ``batch`` x ``seq`` tokens.

    The model with 3 blocks minus the model with 1, halved, is one block; what is left of the
    1-block model is the embedding, final norm, head and loss. The thread counts take turns, and
    each keeps its best time: on a shared machine a noisy stretch then hits all of them alike, and
    noise only ever adds time.
    """

    old = torch.get_num_threads()
    try:
        steps = _block_steps(args, batch, seq)
        best = {t: [math.inf, math.inf] for t in threads}
        start, reps = time.perf_counter(), 0
        while reps < repeats or (time.perf_counter() - start < budget and reps < 50):
            for t in threads:
                torch.set_num_threads(t)
                for i, fn in enumerate(steps):
                    t0 = time.perf_counter()
                    fn()
                    best[t][i] = min(best[t][i], time.perf_counter() - t0)
            reps += 1
        return {t: block_from(b) for t, b in best.items()}
    finally:
        torch.set_num_threads(old)


def fit_block(
    kind: Any, args: Any, seq: int, samples: list[tuple[int, float]], launch_floor: float
) -> tuple[float, float]:
    """(kernel_launch_s, memory_bandwidth) at which the planner's block times are the measured ones.

    The planner's block is T = A(b) + n L + B(b) / bw for microbatch b: GEMMs and attention in A
    (the GEMM curve already fitted), one launch L per op, elementwise bytes B. Two microbatch sizes
    give two equations for L and 1 / bw; what the planner does not model separately (unfused norms,
    rotary embeddings, the CPU attention kernel's own speed, autograd's per-op work) lands in them.
    """

    def block(b: int, launch: float, bw: float) -> float:
        k = replace(kind, kernel_launch_s=launch, memory_bandwidth=bw)
        t = layer_times(k, BlockShape(args, b, seq, dtype="fp32"), RUNTIMES["isthmus"])
        return t.fwd + t.bwd + t.wgrad

    rows = []
    for b, measured in samples:
        a = block(b, 0.0, 1e15)
        n_l = (block(b, 1e-3, 1e15) - a) / 1e-3
        n_b = (block(b, 0.0, 1e12) - a) * 1e12 * kind.memory_bw_fraction  # seconds x bytes/s, at the fraction
        rows.append((n_l, n_b, measured - a))
    (l1, b1, r1), (l2, b2, r2) = rows[0], rows[-1]
    det = l1 * b2 - l2 * b1
    launch, inv = ((r1 * b2 - r2 * b1) / det, (l1 * r2 - l2 * r1) / det) if det else (-1.0, -1.0)
    if launch < launch_floor or inv <= 0:  # noise, or one size only: the launch cost as measured alone
        launch = launch_floor
        inv = max((r1 - l1 * launch) / b1, 1e-12)
    return launch, 1 / inv / kind.memory_bw_fraction


def measure(
    budget: float, threads: int, flavor: str = "small", batch: int = 16, seq: int = 128, repeats: int = 3
) -> dict[str, Any]:
    """Every measurement within about ``budget`` seconds (the gloo ranks' start-up not counted), each
    repeated at least ``repeats`` times (1: a smoke run, whose figures mean nothing).

    One rank alone on one thread: the GEMM curve (matmuls of ``flavor`` at ``batch`` x ``seq``
    tokens and at a half and a quarter of them, cold caches), then the launch cost and memory
    bandwidth that make the planner's block time the measured one at ``batch`` and ``batch / 4``.
    Then the same block on ``threads`` threads, in turns with one thread (the ``-<t>t`` kind's
    speed-up), and, in the two gloo ranks, with both computing at once against one alone
    (``cpu-local``: one rank of several is slower than one alone by what they share: caches,
    memory bandwidth, the rest of the machine).
    """

    start = time.perf_counter()
    base = device_kinds()["cpu"]
    args = get_flavor(flavor)
    tokens = batch * seq
    quarter, half = max(1, batch // 4), max(1, batch // 2)
    sizes = tuple(b for b in ALLREDUCE_BYTES if b <= 256 * 1024 or b / 0.3e9 * 5 <= 0.2 * budget / len(ALLREDUCE_BYTES))
    gemms = measure_gemms(model_gemms(args, tuple(sorted({tokens, half * seq, quarter * seq}))), 0.2 * budget)
    frac, d0, err = fit_gemm_curve(gemms, base.peak("fp32"))
    floor = measure_op_overhead(0.02 * budget)
    kind = replace(base, name="cpu-local", gemm_max_fraction=frac, gemm_half_dim=d0)
    runs = measure_block(args, batch, seq, tuple(sorted({1, threads})), 0.25 * budget, repeats)
    (block_1t, ends_1t), (block_nt, ends_nt) = runs[1], runs[threads]
    block_q = measure_block(args, quarter, seq, (1,), 0.1 * budget, repeats)[1][0] if quarter < batch else block_1t
    # Unresolved block times fit nothing: the kind keeps the cpu kind's launch cost and bandwidth.
    samples = [(b, t) for b, t in ((batch, block_1t), (quarter, block_q)) if t is not None]
    launch, bw = fit_block(kind, args, seq, samples, floor) if samples else (None, None)
    kind = replace(kind, kernel_launch_s=launch or kind.kernel_launch_s, memory_bandwidth=bw or kind.memory_bandwidth)
    gloo, shared, host = measure_gloo(0.2 * budget, sizes, [flavor, half, seq, 0.15 * budget], repeats)
    lat, link_bw = fit_alpha_beta(gloo)
    host_lat, host_bw = fit_alpha_beta(host) if host else (None, None)
    mechanisms = measure_mechanisms(flavor, batch, seq, 0.3 * budget, repeats)
    return {
        "mechanisms": mechanisms,
        "seconds": time.perf_counter() - start,
        "threads": threads,
        "flavor": flavor,
        "batch": batch,
        "seq": seq,
        "gemms": gemms,
        "fraction": frac,
        "half_dim": d0,
        "fit_error": err,
        "launch_s": launch,
        "launch_floor": floor,
        "memory_bandwidth": bw,
        "block_1t": block_1t,
        "block_quarter": block_q,
        "quarter": quarter,
        "ends_1t": ends_1t,
        "block_nt": block_nt,
        "ends_nt": ends_nt,
        "speedup": ratio(block_1t, block_nt),
        "half": half,
        "shared": None if shared is None else max(1.0, shared),
        "gloo": gloo,
        "gloo_lat": lat,
        "gloo_bw": link_bw,
        "host": host,
        "host_lat": host_lat,
        "host_bw": host_bw,
        "base": base,
    }


def ms(seconds: float | None) -> str:
    """A derived time as the profile prints it: milliseconds, or ``unresolved`` (None)."""
    return "unresolved" if seconds is None else f"{seconds * 1e3:.1f} ms"


def times(factor: float | None) -> str:
    """A derived ratio as the profile prints it: ``2.00 x``, or ``unresolved x`` (None)."""
    return "unresolved x" if factor is None else f"{factor:.2f} x"


def topology_toml(prof: dict[str, Any], name: str, cores: int) -> str:
    """The topology file: one rank among ``cores`` busy ones, one rank alone with all threads, one node.

    With ``prof["mechanisms"]`` the 2-rank layouts' per-block overheads are fitted against the
    planner on the file without them (:func:`fit_mechanisms`) and written into ``cpu-local``. A
    figure the timings did not resolve (None) is not written: the kind keeps its base's value (the
    ``-<t>t`` kind, without a speed-up, is left to the planner's estimate), and a comment says so.
    """
    if "mechanisms" in prof and "overheads" not in prof:
        bare = topology_toml({**prof, "overheads": {}}, name, cores)
        prof["overheads"] = fit_mechanisms(bare, prof["flavor"], prof["batch"], prof["seq"], prof["mechanisms"])
    over = prof.get("overheads") or {}
    base = prof["base"]
    t = prof["threads"]
    speed, shared = prof["speedup"], prof["shared"] or 1.0  # unresolved: as fast as one rank alone
    gemms = "\n".join(f"#   {m:>5} x {n:>5} x {k:>5}: {f / 1e9:6.1f} GFLOP/s" for m, n, k, f in prof["gemms"])
    gloo = "\n".join(f"#   {b / 1024:>8.0f} KB: {s * 1e6:9.0f} us" for b, s in prof["gloo"])
    shape = f"{prof['flavor']} at {prof['batch']} x {prof['seq']} tokens"

    def peaks(f: float) -> str:
        return "{ " + ", ".join(f"{k} = {v * f / 1e12:.4f}" for k, v in sorted(base.peak_flops.items())) + " }"

    lines = [
        f"# Written by `isthmus profile` on {socket.gethostname()}, {time.strftime('%Y-%m-%d %H:%M')}, "
        f"in {prof['seconds']:.0f} s",
        f"# (torch fp32 on CPU; {cores} cores; load average {os.getloadavg()[0]:.1f} when it ran).",
        f"# One-thread matmuls of {shape} and its half and quarter (forward, input and weight gradient;",
        "# caches flushed before each; best of repeats):",
        gemms,
        f"# Fitted to the planner's GEMM curve against the cpu kind's {base.peak('fp32') / 1e9:.0f} GFLOP/s peak: "
        f"rms error {100 * prof['fit_error']:.1f}%.",
        f"# One block forward + backward, one thread, alone: {ms(prof['block_1t'])} at {prof['batch']} x {prof['seq']}, "
        f"{ms(prof['block_quarter'])} at {prof['quarter']} x {prof['seq']}:",
        (
            f"# kernel_launch_us and memory_bandwidth_gb_s make the planner's block those times (a small op alone:"
            f" {prof['launch_floor'] * 1e6:.1f} us)."
            if prof["launch_s"] is not None
            else "# unresolved (the 3-block model was not measurably slower than the 1-block one): the cpu kind's "
            "kernel_launch_us and memory_bandwidth_gb_s stay."
        ),
        f"# {t} threads, alone: {ms(prof['block_nt'])} ({times(speed)} one thread, in turns with it) -> "
        + (f"cpu-local-{t}t." if speed is not None else f"no cpu-local-{t}t: the planner estimates it."),
        f"# Two ranks computing at once ({prof['half']} x {prof['seq']} each) against one alone: a block takes "
        f"{times(prof['shared'])} as long -> cpu-local.",
        "# gloo all-reduce between 2 local ranks (median):",
        gloo,
        f"# Fitted: t = 2 x {prof['gloo_lat'] * 1e6:.0f} us + bytes / {prof['gloo_bw'] / 1e9:.3f} GB/s.",
        f'name = "{name}"',
        f'description = "this machine, profiled: {cores} local ranks on {cores} CPU cores, gloo over loopback"',
        "",
        "[devices.cpu-local]",
        'base = "cpu"',
        'description = "one rank on one thread while every core runs a rank (isthmus profile)"',
        f"peak_tflops = {peaks(1 / shared)}",
        f"gemm_max_fraction = {prof['fraction']:.4f}",
        f"gemm_half_dim = {prof['half_dim']:g}",
    ]
    if prof["launch_s"] is not None:
        lines += [
            f"memory_bandwidth_gb_s = {prof['memory_bandwidth'] / shared / 1e9:.3f}",
            f"kernel_launch_us = {prof['launch_s'] * shared * 1e6:.2f}",
        ]
    if over:
        m = prof["mechanisms"]
        lines += [
            "# 2 ranks, one thread each, a whole training step with 1 and with 3 blocks (median ms): "
            + "; ".join(f"{k} {v[0] * 1e3:.0f} / {v[1] * 1e3:.0f}" for k, v in m.items())
            + ".",
            "# What one block adds beyond the planner's count of the same steps (per pass; FSDP2 per collective):",
            *(
                f"{key[:-2]}_us = {over[key] * 1e6:.0f}"
                if over[key] is not None
                else f"# {key[:-2]}_us: unresolved (within the steps' noise, or negative): not written"
                for key in ("tp_block_s", "sp_block_s", "shard_block_s")
            ),
        ]
    lines += [
        "",
    ]
    if t > 1 and speed is not None:
        lines += [
            f"[devices.cpu-local-{t}t]",
            'base = "cpu-local"',
            f'description = "one rank alone with {t} threads on this machine (isthmus profile)"',
            f"peak_tflops = {peaks(speed)}",
            *(
                [
                    f"memory_bandwidth_gb_s = {prof['memory_bandwidth'] * speed / 1e9:.3f}",
                    f"kernel_launch_us = {prof['launch_s'] * 1e6:.2f}",
                ]
                if prof["launch_s"] is not None
                else []
            ),
            "",
        ]
    lines += [
        "[[datacenters]]",
        'name = "local"',
        'device = "cpu-local"',
        "nodes = 1",
        f"devices_per_node = {cores}",
        f"intra_node = {{ bandwidth_gb_s = {prof['gloo_bw'] / 1e9:.4f}, latency_us = {prof['gloo_lat'] * 1e6:.1f} }}",
    ]
    if prof.get("host"):
        lines += [
            "# The shared-memory all-reduce between the same 2 ranks (tensor parallelism's, median):",
            *(f"#   {b / 1024:>8.0f} KB: {s * 1e6:9.0f} us" for b, s in prof["host"]),
            f"host_memory = {{ bandwidth_gb_s = {prof['host_bw'] / 1e9:.4f}, latency_us = {prof['host_lat'] * 1e6:.1f} }}",
        ]
    lines += [""]
    return "\n".join(lines)
