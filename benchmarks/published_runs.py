"""Published runs against the planner, through the CLI: every row of src/isthmus/planner/published_runs.csv.

    python benchmarks/published_runs.py             # the comparison, with median / max error per source
    python benchmarks/published_runs.py --markdown  # the table in docs/planner.md

Each row runs ``isthmus simulate <its args> --runtime <its runtime> --json`` in this process and
compares the simulated figure (and the cost model's) with what the source reported.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys

from isthmus.cli.main import main as isthmus_main
from isthmus.planner.reference import PublishedRun, published_runs, source_micro_batch


def predict(row: PublishedRun) -> dict:
    """The JSON of ``isthmus simulate`` for this row."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = isthmus_main(row.argv())
    if rc != 0:
        raise RuntimeError(f"{row.source} {row.row}: isthmus exited {rc}")
    return json.loads(out.getvalue())


def figures(row: PublishedRun, res: dict) -> tuple[float, float]:
    """(simulated, cost model) value of the row's metric."""
    cost_step = res["simulated"]["cost_model_step_time_s"]
    if row.metric == "step_time_s":
        return res["step_time_s"], cost_step
    devices = res["simulated"]["devices_represented"]
    sim = res["tflops_per_device"] if row.metric == "tflops_per_device" else res["tokens_per_s"] / devices
    cost = sim * res["step_time_s"] / cost_step
    return sim, cost


def error(row: PublishedRun, value: float) -> float:
    """Relative error of a prediction, as throughput: + means predicted faster than published."""
    return row.published / value - 1 if row.metric == "step_time_s" else value / row.published - 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ns = ap.parse_args(argv)
    head = ["source", "row", "runtime", "metric", "published", "simulated", "cost model", "error", "mem GB"]
    if ns.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    by_source: dict[str, list[float]] = {}
    for row in published_runs():
        res = predict(row)
        sim, cost = figures(row, res)
        err = error(row, sim)
        by_source.setdefault(row.source, []).append(err)
        cells = [
            row.source,
            row.row,
            row.runtime,
            row.metric,
            f"{row.published:g}",
            f"{sim:.4g}",
            f"{cost:.4g}",
            f"{100 * err:+.1f}%",
            f"{res['mem_per_device_gb']:.1f}",
        ]
        print(("| " + " | ".join(cells) + " |") if ns.markdown else "  ".join(cells))
    print()
    allerr = [abs(e) for errs in by_source.values() for e in errs]
    for src, errs in by_source.items():
        a = [abs(e) for e in errs]
        print(f"{src}: {len(a)} rows, median |error| {100 * statistics.median(a):.1f}%, max {100 * max(a):.1f}%")
    print(
        f"all: {len(allerr)} rows, median |error| {100 * statistics.median(allerr):.1f}%, max {100 * max(allerr):.1f}%"
    )
    for src in by_source:
        rows = [r for r in published_runs() if r.source == src]
        if implied := source_micro_batch(rows):
            print(
                f"{src}: the published times fit one 1F1B pipeline at micro-batch {implied:.2f} (rows run {rows[0].option('--micro-batch')})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
