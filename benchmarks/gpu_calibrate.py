"""Calibrate a GPU's device kind for the planner and check CUDA training against the CPU: one script for a lent GPU.

    python benchmarks/gpu_calibrate.py --out calibration               # on a GPU machine, about 4 minutes
    python benchmarks/gpu_calibrate.py --device cpu --quick --out DIR  # the same code on CPU, small shapes

Each part prints as it finishes; everything lands in ``<out>/calibration.json``, and the fitted kind in
``<out>/device.toml`` (a ``[devices.<name>]`` table on the shipped kind, ready for a topology file):

1. correctness: `isthmus train --model.flavor tiny`, 4 fp32 steps on the device and on the CPU from the
   same seed, losses compared; with two or more GPUs also tp 2 over NCCL against the one-device run.
2. GEMMs: every matmul of a llama3-8b block and head in its three training forms (forward, input and
   weight gradient) at 8,192 tokens in bf16; the planner's GEMM curve (``gemm_max_fraction``,
   ``gemm_half_dim``) fitted to them, as ``isthmus profile`` fits the CPU's.
3. memory: an elementwise add's bandwidth (``memory_bw_fraction`` of the datasheet's) and a tiny kernel's
   time (``kernel_launch_us``).
4. attention: causal SDPA (32 heads of 128) at 2,048 and 8,192 tokens, forward and backward, as
   ``planner.compute`` prices fused attention: the share of the GEMM curve at the (s, s) score tiles it
   reaches (the kind's ``attention_fraction``: h100-sxm 0.41, a100-80g's default 0.56) and backward over
   forward (``FLASH_BACKWARD_FACTOR``, 2.5). The longest sequence's share goes into the fitted kind.
5. collectives: all-reduce bus bandwidth over every GPU (NCCL) when there are two or more; one GPU
   has none to measure and says so.
6. steps: a llama3-8b-shaped model with 2 blocks (bf16 autocast, AdamW, isthmus.api as the trainer
   runs it) at four layouts on one device, each predicted by the planner with the shipped kind, the
   GEMM fit, and the fit with ``gemm_max_fraction`` solved so the first layout's prediction is its
   measurement (a whole program's share of the lone GEMMs' rate, as a100-80g's was solved against
   Megatron-LM's Table 1); predicted against measured printed for each.

Why a script and not `isthmus profile`: profile measures a CPU rank's runtime work against gloo; a
GPU's constants come from kernels and need a GPU, which this project borrows for minutes at a time,
so everything to measure is in one prepared run. ``--device cpu --quick`` runs the same code at the
``small`` flavor's shapes (tests/profile/test_gpu_calibrate.py), so the script works before the GPU comes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from isthmus.api import clip_grad_norm, parallelize, step
from isthmus.config import TrainConfig
from isthmus.layout.spec import LayoutSpec
from isthmus.models.flavors import get_flavor
from isthmus.models.llama import build_model
from isthmus.parallel.rendezvous import loopback_store_server, served_group_args
from isthmus.planner.compute import CAUSAL_SKIP, attention_fraction
from isthmus.planner.cost import estimate
from isthmus.planner.topology import DeviceKind, Topology, device_kinds, load_topology
from isthmus.planner.workload import RUNTIMES, Workload
from isthmus.profile.measure import fit_gemm_curve, model_gemms
from isthmus.train.optim import build_optimizer
from plan_vs_measured import train_argv  # the script's folder is on sys.path

LOSS_RTOL = 1e-4
"""fp32 losses on the device against the CPU's: summation order differs, nothing else may."""


@dataclass(frozen=True)
class Shapes:
    """What one run measures: the full set on a GPU, the small one for ``--quick`` on CPU."""

    flavor: str
    dtype: str
    gemm_tokens: int
    attention_seqs: tuple[int, ...]
    heads: int
    head_dim: int
    layers: int
    steps: tuple[tuple[int, int, str], ...]
    """(micro-batch, sequence, activation checkpointing) of each timed layout; the first is solved for."""
    elementwise_mib: int
    reps: int


FULL = Shapes(
    "llama3-8b",
    "bf16",
    8192,
    (2048, 8192),
    32,
    128,
    2,
    ((1, 8192, "none"), (2, 4096, "none"), (1, 8192, "selective"), (1, 8192, "full")),
    1024,
    10,
)
QUICK = Shapes("small", "fp32", 2048, (128, 256), 4, 64, 2, ((4, 128, "none"), (4, 128, "full")), 64, 3)


def base_kind(device: torch.device) -> str:
    """The shipped kind whose datasheet peaks this device has."""
    if device.type == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    for key, kind in (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80g")):
        if key in name:
            return kind
    raise SystemExit(f"gpu_calibrate: no shipped device kind for {name!r} (h200, h100-sxm, a100-80g)")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, reps: int, inner: int = 1) -> float:
    """Median seconds of one call of ``fn`` over ``reps`` timings of ``inner`` calls each (after a warm-up)."""
    fn()
    sync(device)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(device)
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


# --- 1. correctness ---------------------------------------------------------------------------------


def train_losses(device: str, work: Path, tag: str, *flags: str) -> list[float]:
    """Losses of 4 fp32 steps of `isthmus train --model.flavor tiny` on ``device``."""
    jsonl = work / f"{tag}.jsonl"
    cmd = train_argv(
        "tiny", 4, work / tag, "--train.dtype", "fp32", "--train.device", device,
        "--metrics.log_every", "1", "--metrics.jsonl", str(jsonl), *flags,
    )  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()[-1500:]}")
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    return [r["loss"] for r in records if "loss" in r and "step_time_s" in r]


def correctness(device: torch.device, work: Path) -> dict[str, Any]:
    ref = train_losses("cpu", work, "cpu")
    runs = {f"{device.type} 1 device": train_losses(device.type, work, "one-device")}
    if device.type == "cuda" and torch.cuda.device_count() >= 2:
        runs["cuda tp 2 (nccl)"] = train_losses("cuda", work, "cuda-tp2", "--parallel.nproc", "2", "--parallel.tp", "2")
    out: dict[str, Any] = {"cpu": ref}
    for name, losses in runs.items():
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True))
        out[name] = {"losses": losses, "max_rel_diff": worst, "ok": worst <= LOSS_RTOL}
        print(f"  {name}: losses {[f'{x:.6f}' for x in losses]}, max relative diff from CPU {worst:.2e}")
    return out


# --- 2-4. kernels -----------------------------------------------------------------------------------


def gemms(device: torch.device, shapes: Shapes, kind: DeviceKind) -> dict[str, Any]:
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[shapes.dtype]
    samples = []
    for m, n, k in model_gemms(get_flavor(shapes.flavor), (shapes.gemm_tokens,)):
        a = torch.randn(m, k, device=device, dtype=dt)
        b = torch.randn(k, n, device=device, dtype=dt)
        seconds = timed(lambda a=a, b=b: a @ b, device, shapes.reps, inner=3)
        samples.append((m, n, k, 2 * m * n * k / seconds))
        del a, b
    frac, d0, err = fit_gemm_curve(samples, kind.peak(shapes.dtype))
    for m, n, k, f in samples:
        print(f"  ({m:>6}, {n:>6}, {k:>6}): {f / 1e12:8.1f} TFLOP/s, {f / kind.peak(shapes.dtype):.3f} of peak")
    print(f"  fit: gemm_max_fraction {frac:.3f}, gemm_half_dim {d0:g} (rms error {err:.1%})")
    return {"samples": samples, "gemm_max_fraction": frac, "gemm_half_dim": d0, "fit_rms": err}


def memory(device: torch.device, shapes: Shapes, kind: DeviceKind) -> dict[str, float]:
    n = shapes.elementwise_mib * 2**20 // 4
    x, y = torch.randn(n, device=device), torch.randn(n, device=device)
    z = torch.empty_like(x)
    seconds = timed(lambda: torch.add(x, y, out=z), device, shapes.reps, inner=3)
    bandwidth = 3 * 4 * n / seconds  # two reads, one write
    tiny = torch.ones(8, device=device)
    launch = timed(lambda: tiny.add_(1.0), device, shapes.reps, inner=200)
    out = {
        "bandwidth_gb_s": bandwidth / 1e9,
        "memory_bw_fraction": bandwidth / kind.memory_bandwidth,
        "kernel_launch_us": launch * 1e6,
    }
    print(
        f"  elementwise add {out['bandwidth_gb_s']:.0f} GB/s = {out['memory_bw_fraction']:.3f} of the datasheet's;"
        f" a tiny kernel {out['kernel_launch_us']:.1f} us"
    )
    return out


def attention(device: torch.device, shapes: Shapes, kind: DeviceKind) -> list[dict[str, float]]:
    """Causal SDPA against ``compute.layer_ops``'s price: a launch plus CAUSAL_SKIP x 4 b h s^2 d FLOPs at
    the GEMM curve's rate over (s, s) score tiles (no head-dim term) x the kind's ``attention_fraction``
    forward, FLASH_BACKWARD_FACTOR forwards backward; the fraction each sequence measures is printed."""
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[shapes.dtype]
    rows = []
    for s in shapes.attention_seqs:
        q, k, v = (
            torch.randn(1, shapes.heads, s, shapes.head_dim, device=device, dtype=dt, requires_grad=True)
            for _ in range(3)
        )
        grad = torch.randn(1, shapes.heads, s, shapes.head_dim, device=device, dtype=dt)

        def fwd() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd() -> None:
            torch.autograd.grad(fwd(), (q, k, v), grad)

        with torch.no_grad():
            t_fwd = timed(fwd, device, shapes.reps, inner=3)
        t_both = timed(fwd_bwd, device, shapes.reps, inner=3)
        flops = 4 * shapes.heads * s * s * shapes.head_dim
        # The curve layer_ops prices fused attention on, at an attention_fraction of 1: what is left is the kind's.
        curve = kind.peak(shapes.dtype) * attention_fraction(kind, s, s) / kind.attention_fraction
        kernel = t_fwd - kind.kernel_launch_s if t_fwd > 2 * kind.kernel_launch_s else t_fwd
        row = {
            "seq": s,
            "fwd_ms": t_fwd * 1e3,
            "bwd_ms": (t_both - t_fwd) * 1e3,
            "attention_fraction": CAUSAL_SKIP * flops / (kernel * curve),
            "flash_backward_factor": (t_both - t_fwd) / t_fwd,
        }
        rows.append(row)
        print(
            f"  seq {s}: forward {row['fwd_ms']:.2f} ms, backward {row['bwd_ms']:.2f} ms; attention_fraction"
            f" {row['attention_fraction']:.2f} (the kind's {kind.attention_fraction:.2f}), backward / forward"
            f" {row['flash_backward_factor']:.2f} (assumed 2.5)"
        )
    return rows


# --- 5. collectives -----------------------------------------------------------------------------------


def _collective_worker(rank: int, world: int, port: int, backend: str, sizes: list[int], reps: int, out: str) -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, **served_group_args(port, rank, world))
    rows = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, device=device)
        dist.barrier()
        seconds = timed(lambda t=t: dist.all_reduce(t), device, reps)
        rows.append(
            {"bytes": nbytes, "ms": seconds * 1e3, "bus_gb_s": 2 * (world - 1) / world * nbytes / seconds / 1e9}
        )
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def collectives(device: torch.device, shapes: Shapes) -> dict[str, Any]:
    """NCCL over every GPU; on CPU (``--quick``) gloo over 2 ranks, the same code."""
    world = torch.cuda.device_count() if device.type == "cuda" else 2
    if world < 2:
        print("  one GPU: no all-reduce between devices to measure (the bus bandwidth needs two or more)")
        return {"skipped": "one device"}
    backend = "nccl" if device.type == "cuda" else "gloo"
    sizes = [2**20, 2**24, 2**28] if device.type == "cuda" else [2**16, 2**20]
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, loopback_store_server() as port:
        out = os.path.join(tmp, "rows.json")
        procs = [
            ctx.Process(target=_collective_worker, args=(r, world, port, backend, sizes, shapes.reps, out))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
        if any(p.exitcode for p in procs) or not os.path.exists(out):
            raise RuntimeError(f"all-reduce ranks failed: exit codes {[p.exitcode for p in procs]}")
        rows = json.loads(Path(out).read_text())
    for r in rows:
        print(
            f"  {backend} all-reduce over {world}: {r['bytes'] / 2**20:g} MiB in {r['ms']:.3f} ms, bus {r['bus_gb_s']:.1f} GB/s"
        )
    return {"backend": backend, "world": world, "rows": rows}


# --- 6. steps ---------------------------------------------------------------------------------------


def one_device(kind: DeviceKind) -> Topology:
    """A topology of one device of ``kind`` (a one-datacenter preset reshaped, as
    ``autoplan.local_topology`` reshapes ``local``; its links are never used by one device)."""
    base = load_topology("meta-h100")
    dc = replace(base.datacenters[0], kind=kind, nodes=1, devices_per_node=1)
    return replace(base, name="calibration", datacenters=(dc,))


def predict(kind: DeviceKind, shapes: Shapes, micro: int, seq: int, ac: str) -> float:
    args = replace(get_flavor(shapes.flavor), n_layers=shapes.layers)
    layout = LayoutSpec(micro_batch=micro, microbatches=1, activation_checkpoint=ac)  # type: ignore[arg-type]
    return estimate(Workload(args, micro, seq, shapes.dtype), one_device(kind), layout, RUNTIMES["isthmus"]).step_time_s


def measure_step(device: torch.device, shapes: Shapes, micro: int, seq: int, ac: str) -> float:
    """Median seconds of a training step (forward, backward, clipping, AdamW) as the trainer runs one."""
    args = replace(get_flavor(shapes.flavor), n_layers=shapes.layers)
    layout = LayoutSpec(activation_checkpoint=ac)  # type: ignore[arg-type]
    pm = parallelize(build_model(args, device="meta"), layout, device=device, dtype=shapes.dtype, seq_len=seq)
    opt = build_optimizer(pm.modules, TrainConfig(lr=1e-4))
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab_size, (micro, seq + 1), generator=gen).to(device)

    def train_step() -> None:
        step(pm, x[:, :-1], x[:, 1:])
        clip_grad_norm(pm, 1.0, None)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed(train_step, device, shapes.reps)


def solve_fraction(kind: DeviceKind, shapes: Shapes, measured: float) -> float:
    """The gemm_max_fraction under which the planner predicts the first layout's measured step."""
    lo, hi = 0.01, 1.0
    for _ in range(40):  # the prediction falls as the fraction grows
        mid = (lo + hi) / 2
        if predict(replace(kind, gemm_max_fraction=mid), shapes, *shapes.steps[0]) > measured:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def steps(device: torch.device, shapes: Shapes, kinds: dict[str, DeviceKind]) -> dict[str, Any]:
    measured = []
    for lay in shapes.steps:
        measured.append(measure_step(device, shapes, *lay))
        if device.type == "cuda":  # the last layout's model and optimizer are gone: hand their memory back
            torch.cuda.empty_cache()
    solved = solve_fraction(kinds["fit"], shapes, measured[0])
    kinds = {**kinds, "solved": replace(kinds["fit"], gemm_max_fraction=solved)}
    rows = []
    for lay, got in zip(shapes.steps, measured, strict=True):
        pred = {name: predict(k, shapes, *lay) for name, k in kinds.items()}
        rows.append({"micro_batch": lay[0], "seq": lay[1], "ac": lay[2], "measured_s": got, "predicted_s": pred})
        cells = ", ".join(f"{name} {p * 1e3:.1f} ms ({got / p - 1:+.1%})" for name, p in pred.items())
        print(f"  mb {lay[0]} x seq {lay[1]}, ac {lay[2]}: measured {got * 1e3:.1f} ms; predicted {cells}")
    print(f"  whole-program gemm_max_fraction (solved on the first layout): {solved:.3f}")
    return {"rows": rows, "solved_gemm_max_fraction": solved}


def device_toml(
    base: str, name: str, fit: dict[str, Any], mem: dict[str, float], solved: float, gpu: str, attention: float | None
) -> str:
    share = [] if attention is None else [f"attention_fraction = {min(attention, 1.0):.3f}"]
    return "\n".join(
        [
            f"[devices.{name}]",
            f'base = "{base}"',
            f'description = "{gpu}, measured by benchmarks/gpu_calibrate.py on {time.strftime("%Y-%m-%d")}"',
            f"gemm_max_fraction = {solved:.3f}  # whole program; lone GEMMs {fit['gemm_max_fraction']:.3f}",
            f"gemm_half_dim = {fit['gemm_half_dim']:g}",
            f"memory_bw_fraction = {min(mem['memory_bw_fraction'], 1.0):.3f}",
            f"kernel_launch_us = {mem['kernel_launch_us']:.1f}",
            *share,
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="the small flavor's shapes (a check of the script)")
    ap.add_argument("--out", default="calibration", help="folder for calibration.json and device.toml")
    ns = ap.parse_args(argv)
    if ns.device == "cuda" and not torch.cuda.is_available():
        print("gpu_calibrate: no CUDA device here (--device cpu --quick runs the same code on CPU)", file=sys.stderr)
        return 2
    device = torch.device(ns.device, 0) if ns.device == "cuda" else torch.device("cpu")
    shapes = QUICK if ns.quick else FULL
    if device.type == "cpu":
        torch.set_num_threads(1)  # the cpu kind is one core
    else:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 in the correctness check
    base = base_kind(device)
    kind = device_kinds()[base]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": gpu, "base_kind": base, "torch": torch.__version__, "shapes": shapes.flavor}
    print(f"{gpu} (shipped kind {base}), torch {torch.__version__}, {shapes.flavor} shapes in {shapes.dtype}")
    failed: list[str] = []

    def part(title: str, key: str, fn: Callable[[], Any]) -> Any:
        """Run one part; a part that fails is reported and the rest still run (a lease is minutes long)."""
        print(title, flush=True)
        try:
            report[key] = fn()
        except Exception as exc:  # noqa: BLE001 - any failure is a finding; the next part still runs
            report[key] = {"failed": f"{type(exc).__name__}: {exc}"}
            failed.append(key)
            print(f"  failed: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
        return report[key]

    with tempfile.TemporaryDirectory() as work:
        part("1. correctness (tiny, fp32, 4 steps)", "correctness", lambda: correctness(device, Path(work)))
    fit = kind
    if "failed" not in part("2. GEMMs", "gemm", lambda: gemms(device, shapes, kind)):
        fit = replace(
            fit, gemm_max_fraction=report["gemm"]["gemm_max_fraction"], gemm_half_dim=report["gemm"]["gemm_half_dim"]
        )
    if "failed" not in part("3. memory", "memory", lambda: memory(device, shapes, kind)):
        fit = replace(
            fit,
            memory_bw_fraction=min(report["memory"]["memory_bw_fraction"], 1.0),
            kernel_launch_s=report["memory"]["kernel_launch_us"] / 1e6,
        )
    fitted_attention = None
    rows = part("4. attention", "attention", lambda: attention(device, shapes, fit))
    if "attention" not in failed:
        fitted_attention = min(rows[-1]["attention_fraction"], 1.0)  # the longest sequence's
        fit = replace(fit, attention_fraction=fitted_attention)
    part("5. collectives", "collectives", lambda: collectives(device, shapes))
    title = f"6. steps ({shapes.flavor} shape, {shapes.layers} blocks, one device)"
    part(title, "steps", lambda: steps(device, shapes, {"shipped": kind, "fit": fit}))
    (out / "calibration.json").write_text(json.dumps(report, indent=1))
    written = [out / "calibration.json"]
    if not {"gemm", "memory", "steps"} & set(failed):
        name = f"{base}-measured"
        solved = report["steps"]["solved_gemm_max_fraction"]
        toml = device_toml(base, name, report["gemm"], report["memory"], solved, gpu, fitted_attention)
        (out / "device.toml").write_text(toml)
        written.append(out / "device.toml")
    print(f"wrote {' and '.join(map(str, written))}")
    checks = report["correctness"]
    bad = (
        [k for k, v in checks.items() if isinstance(v, dict) and not v.get("ok", True)]
        if "failed" not in checks
        else []
    )
    if bad:
        print(f"gpu_calibrate: losses differ from the CPU's beyond {LOSS_RTOL:g}: {', '.join(bad)}", file=sys.stderr)
    if failed:
        print(f"gpu_calibrate: part(s) failed: {', '.join(failed)} (calibration.json says why)", file=sys.stderr)
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
