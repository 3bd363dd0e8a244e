"""Published runs against the planner, through the CLI: every row of src/isthmus/planner/published_runs.csv.

    python benchmarks/published_runs.py             # the comparison, with median / max error per source
    python benchmarks/published_runs.py --markdown  # the table in docs/planner-checks.md
    python benchmarks/published_runs.py --markdown --sources megatron-bridge-h100,nemo2024-h100   # some sources
    python benchmarks/published_runs.py --plot docs/img/published_runs.svg   # and the scatter

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
from pathlib import Path

from isthmus.cli.main import main as isthmus_main
from isthmus.planner.reference import PublishedRun, published_runs, source_micro_batch
from isthmus.train.short_run import capped

sys.path.insert(0, str(Path(__file__).resolve().parent))  # plots.py, a sibling


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
    if row.metric == "mfu":
        sim = res["mfu"]
    else:
        sim = res["tflops_per_device"] if row.metric == "tflops_per_device" else res["tokens_per_s"] / devices
    cost = sim * res["step_time_s"] / cost_step
    return sim, cost


def error(row: PublishedRun, value: float) -> float:
    """Relative error of a prediction, as throughput: + means predicted faster than published."""
    return row.published / value - 1 if row.metric == "step_time_s" else value / row.published - 1


def plot(points: list[tuple[str, float, float]], path: str) -> None:
    """Predicted against published step time, one point per row coloured by source, in the band where
    the error (as throughput) is within 10%; beside it, each row's error. A row published as a rate
    is shown as the step time that rate means for the simulated step: predicted step x (1 + error)."""
    import plots

    plt = plots.pyplot()
    if plt is None:
        return
    fig, (ax, err) = plt.subplots(1, 2, figsize=(10, 4.4), gridspec_kw={"width_ratios": [1.1, 1]})
    low, high = min(min(p[1], p[2]) for p in points) / 1.5, max(max(p[1], p[2]) for p in points) * 1.5
    line = [low, high]
    ax.fill_between(line, [x / 1.1 for x in line], [x / 0.9 for x in line], color="0.88", label="within 10%")
    ax.plot(line, line, color="0.5", lw=0.8)
    err.axhspan(-10, 10, color="0.88")
    err.axhline(0, color="0.5", lw=0.8)
    for source in dict.fromkeys(p[0] for p in points):
        mine = [p for p in points if p[0] == source]
        ax.scatter([p[1] for p in mine], [p[2] for p in mine], s=18, label=f"{source} ({len(mine)})")
        err.scatter([p[1] for p in mine], [100 * (p[1] / p[2] - 1) for p in mine], s=18)
    ax.set(xscale="log", yscale="log", xlim=line, ylim=line)
    ax.set(xlabel="published step time, s", ylabel="predicted step time, s (isthmus simulate)")
    ax.legend(fontsize=7, loc="upper left")
    err.set(xscale="log", xlim=line, ylim=(-15, 15), xlabel="published step time, s")
    err.set(ylabel="error as throughput, % (+: predicted faster)")
    fig.suptitle(f"{len(points)} published runs against isthmus's simulator")
    plots.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument(
        "--plot", default="", help="also draw predicted against published step time to this file (.svg, .png)"
    )
    ap.add_argument("--sources", default="", help="only these sources (a comma list of the csv's `source`)")
    ns = ap.parse_args(argv)
    wanted = {x for x in ns.sources.split(",") if x}
    points: list[tuple[str, float, float]] = []
    head = ["source", "row", "layout", "runtime", "metric", "published", "simulated", "cost model", "error", "mem GB"]
    if ns.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    by_source: dict[str, list[float]] = {}
    unfitted: list[tuple[bool, float]] = []
    chosen = [row for row in published_runs() if not wanted or row.source in wanted]
    if capped(len(chosen)) < len(chosen):  # ISTHMUS_MAX_STEPS (the docs' commands in the tests): a smoke run
        print(f"ISTHMUS_MAX_STEPS: the first {capped(len(chosen))} of {len(chosen)} rows; the figures mean nothing")
        chosen = chosen[: capped(len(chosen))]
    for row in chosen:
        res = predict(row)
        sim, cost = figures(row, res)
        err = error(row, sim)
        by_source.setdefault(row.source, []).append(err)
        unfitted.append(("CALIBRATES" in row.table, err))
        points.append((row.source, res["step_time_s"] * (1 + err), res["step_time_s"]))
        cells = [
            row.source,
            row.row + (" (fitted)" if "CALIBRATES" in row.table else ""),
            f"`{res['label']}`" if ns.markdown else res["label"],
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
    checks = [abs(e) for fitted, e in unfitted if not fitted]
    if len(checks) < len(unfitted) and checks:
        print(
            f"not fitted: {len(checks)} rows, median |error| {100 * statistics.median(checks):.1f}%, max {100 * max(checks):.1f}%"
        )
    for src in by_source:
        rows = [r for r in published_runs() if r.source == src]
        if implied := source_micro_batch(rows):
            print(
                f"{src}: the published times fit one 1F1B pipeline at micro-batch {implied:.2f} (rows run {rows[0].option('--micro-batch')})"
            )
    if ns.plot:
        plot(points, ns.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
