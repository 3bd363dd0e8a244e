"""Predicted vs published per-GPU TFLOP/s for every row of Megatron-LM 2021 Table 1.

    python benchmarks/megatron_table1.py             # the comparison
    python benchmarks/megatron_table1.py --markdown  # the table in docs/planner-checks.md
    python benchmarks/megatron_table1.py --fit       # the calibration grid of the a100-80g constants

Each row is evaluated with the cost model at the paper's own layout (tp, pp, GPUs, batch), on the
selene-a100 preset, under the megatron-2021 runtime assumptions (docs/runtimes.md lists them all).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import replace

from isthmus.planner.reference import MEGATRON_2021_TABLE1, megatron_row_estimate
from isthmus.planner.topology import Topology, load_topology


def with_a100(topo: Topology, **constants: float) -> Topology:
    dc = topo.datacenters[0]
    return replace(topo, datacenters=(replace(dc, kind=replace(dc.kind, **constants)),))


def errors(topo: Topology) -> list[float]:
    return [megatron_row_estimate(r, topo).tflops_per_device / r.tflops_per_gpu - 1 for r in MEGATRON_2021_TABLE1]


def fit() -> None:
    """Every combination of the three a100-80g efficiency constants, best max |error| first."""
    base = load_topology("selene-a100")
    grid = itertools.product((0.66, 0.68, 0.70, 0.72, 0.74, 0.76), (16, 32, 48, 64), (0.75, 0.80, 0.85, 0.90))
    scored = []
    for f, d0, bw in grid:
        errs = errors(with_a100(base, gemm_max_fraction=f, gemm_half_dim=d0, memory_bw_fraction=bw))
        scored.append((max(abs(e) for e in errs), f, d0, bw))
    print("max|err|  gemm_max_fraction  gemm_half_dim  memory_bw_fraction")
    for worst, f, d0, bw in sorted(scored)[:8]:
        print(f"{100 * worst:7.1f}%  {f:17.2f}  {d0:13g}  {bw:18.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument("--fit", action="store_true", help="print the calibration grid instead")
    ns = ap.parse_args(argv)
    if ns.fit:
        fit()
        return 0
    rows, worst = [], 0.0
    for row in MEGATRON_2021_TABLE1:
        est = megatron_row_estimate(row)
        err = est.tflops_per_device / row.tflops_per_gpu - 1
        worst = max(worst, abs(err))
        rows.append((row, est, err))
    head = [
        "model",
        "heads",
        "hidden",
        "layers",
        "tp",
        "pp",
        "GPUs",
        "batch",
        "dp",
        "microbatches",
        "schedule",
        "published TFLOP/s",
        "predicted",
        "error",
        "bubble",
        "mem GB",
    ]
    if ns.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    for row, est, err in rows:
        lay = est.layout
        sched = (
            "-"
            if lay.pp == 1
            else (
                f"interleaved v={lay.pp_virtual_stages}" if lay.pp_schedule == "interleaved_1f1b" else lay.pp_schedule
            )
        )
        cells = [
            f"{row.params_b}B",
            row.heads,
            row.hidden,
            row.layers,
            row.tp,
            row.pp,
            row.gpus,
            row.global_batch,
            lay.dp,
            lay.microbatches_per_step,
            sched,
            row.tflops_per_gpu,
            f"{est.tflops_per_device:.1f}",
            f"{100 * err:+.1f}%",
            f"{100 * est.bubble_fraction:.1f}%",
            f"{est.mem_per_device_gb:.1f}",
        ]
        print(("| " + " | ".join(map(str, cells)) + " |") if ns.markdown else "  ".join(f"{c!s:>9}" for c in cells))
    print(f"\nmax |error| = {100 * worst:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
