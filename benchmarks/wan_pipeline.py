"""A pipeline across two emulated datacenters: naive vs multi-connection vs time-shared WAN transfers vs a geo-sync strategy.

    python benchmarks/wan_pipeline.py --window-kib 64 --out runs.json    # run, print the table
    python benchmarks/wan_pipeline.py --table runs.json more.json         # the table again, rounds joined
    python benchmarks/wan_pipeline.py --mbit 20 --rtt-ms 80 --variants naive,multi_ts --rounds 1

Every run is a real `isthmus emulate --topology emulated-2dc --wan-mbit R --wan-rtt-ms T -- train`
(root; network namespaces, tc tbf, the user-space delay line; with --window-kib, `--wan-window-kib`
limits every TCP window, so one flow carries at most window / RTT), the `small` flavor, 2 datacenters x 2
CPU ranks, global batch 16 x 128. The pipeline variants put pp 2 with the stage boundary on the WAN
(`geo.dc_axis = pp`) and 2 pipelines (dp_replicate 2) whose activations and gradients cross the
same link, 1F1B with 4 microbatches:

- naive: one connection per transfer, the pipelines share the link (fair);
- multi: `geo.wan_streams` connections per transfer (--streams, 4);
- multi_ts: the same, and the pipelines take the link in turn (`geo.wan_schedule = time_shared`);
- geo_sync: no pipeline across the WAN: each datacenter runs the pp 2 pipeline on its own 2 ranks
  (`geo.dc_axis = dp`) and streaming DiLoCo (2 fragments, every 2 inner steps, int4) keeps them in
  step over `geo.wan_streams` connections; its losses differ by design.

Each round runs every variant once per setting, alternating the order between rounds; a variant's
step time is the median of rank 0's `step_time_s` over steps 2.. of all its rounds (step 1 builds the
schedule). The pipeline variants run the same seed and data: their losses must be equal (striping
and turns move bytes only). "Predicted" is `isthmus.planner.estimate` for the same layout on
`emulated-2dc` with the WAN set to the rate, latency and TCP window.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from isthmus.layout.spec import LayoutSpec
from isthmus.models.flavors import get_flavor
from isthmus.planner.cost import estimate
from isthmus.planner.topology import load_topology
from isthmus.planner.workload import RUNTIMES, Workload
from isthmus.sim import simulate
from isthmus.train.short_run import capped, max_steps_override

FLAVOR, BATCH, SEQ, MICROBATCHES = "small", 16, 128, 4
PIPELINE = ["--parallel.pp", "2", "--parallel.dp_replicate", "2", "--geo.dc_axis", "pp"]
GEO_SYNC = ["--parallel.pp", "2", "--geo.dc_axis", "dp", "--geo.sync", "streaming_diloco"]
GEO_SYNC += ["--geo.inner_steps", "2", "--geo.fragments", "2"]
VARIANTS = ("naive", "multi", "multi_ts", "geo_sync")


def variant_flags(variant: str, streams: int) -> list[str]:
    """The train flags that make ``variant`` (see the module docstring)."""
    if variant == "naive":
        return [*PIPELINE, "--geo.wan_streams", "1"]
    if variant == "multi":
        return [*PIPELINE, "--geo.wan_streams", str(streams)]
    if variant == "multi_ts":
        return [*PIPELINE, "--geo.wan_streams", str(streams), "--geo.wan_schedule", "time_shared"]
    assert variant == "geo_sync", variant
    return [*GEO_SYNC, "--geo.wan_streams", str(streams)]


def run(
    mbit: float, rtt_ms: float, window_kib: int, flags: list[str], steps: int, out: Path
) -> tuple[list[float], list[float]]:
    """(rank 0's step seconds from step 2 on, the losses) of one emulated run."""
    metrics = out / "metrics.jsonl"
    cmd = [sys.executable, "-m", "isthmus", "emulate", "--topology", "emulated-2dc"]
    cmd += ["--wan-mbit", f"{mbit:g}", "--wan-rtt-ms", f"{rtt_ms:g}", "--wan-window-kib", str(window_kib)]
    cmd += ["--timeout", "600", "--log-dir", str(out / "logs"), "--", "train"]
    cmd += ["--model.flavor", FLAVOR, "--parallel.nproc", "4", "--parallel.microbatches", str(MICROBATCHES)]
    cmd += ["--geo.datacenters", "2", "--train.batch_size", str(BATCH), "--train.seq_len", str(SEQ)]
    cmd += ["--train.steps", str(steps), "--train.val_every", "0", "--train.run_dir", str(out / "run")]
    cmd += ["--metrics.jsonl", str(metrics), "--metrics.progress", "false", *flags]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{mbit:g} Mbit/s, {rtt_ms:g} ms, {flags} failed:\n{proc.stdout[-3000:]}")
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    return [r["step_time_s"] for r in records[1:]], [r["loss"] for r in records]


def predicted(variant: str, mbit: float, rtt_ms: float, window_kib: int, streams: int) -> tuple[float, float]:
    """(the planner's, the simulator's) step seconds for ``variant`` on ``emulated-2dc`` with this WAN."""
    topo = load_topology("emulated-2dc").with_wan(
        bandwidth_gb_s=mbit / 8 / 1000, latency_us=rtt_ms * 1000 / 2, window_kib=window_kib or None
    )
    base = LayoutSpec(pp=2, microbatches=MICROBATCHES, datacenters=2, wan_streams=1 if variant == "naive" else streams)
    if variant == "geo_sync":
        lay = base.with_(dp_replicate=1, dc_axis="dp", sync="streaming_diloco", inner_steps=2, fragments=2)
    else:
        ts = "time_shared" if variant == "multi_ts" else "fair"
        lay = base.with_(dp_replicate=2, dc_axis="pp", wan_schedule=ts)  # type: ignore[arg-type]
    lay = lay.with_(micro_batch=BATCH // (lay.dp * MICROBATCHES))
    work = Workload(get_flavor(FLAVOR), BATCH, SEQ, "fp32")
    runtime = RUNTIMES["isthmus"]
    return estimate(work, topo, lay, runtime).step_time_s, simulate(work, topo, lay, runtime).step_time_s


def measure(ns: argparse.Namespace) -> dict[str, Any]:
    """Run every setting and variant ``ns.rounds`` times; the raw step times and losses."""
    variants = ns.variants.split(",")
    rows = []
    settings = [(float(m), float(r)) for m in ns.mbit.split(",") for r in ns.rtt_ms.split(",")]
    # ISTHMUS_MAX_STEPS (a smoke run, as the docs' test runs it): the first setting and variant only
    # (each emulated training takes half a minute to start and stop), at most N rounds and steps.
    if max_steps_override() is not None:
        settings, variants = settings[:1], variants[:1]
    ns.rounds, ns.steps = capped(ns.rounds), capped(ns.steps)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (mbit, rtt) in enumerate(settings):
            times: dict[str, list[float]] = {v: [] for v in variants}
            losses: dict[str, list[float]] = {}
            for rnd in range(ns.first_round, ns.first_round + ns.rounds):
                # The order alternates between rounds and settings: no variant always runs first.
                for v in variants if (i + rnd) % 2 == 0 else variants[::-1]:
                    out = Path(tmp) / f"{mbit:g}-{rtt:g}-{v}-{rnd}"
                    t, loss = run(mbit, rtt, ns.window_kib, variant_flags(v, ns.streams), ns.steps, out)
                    times[v] += t
                    losses.setdefault(v, loss)
                    load = os.getloadavg()[0]
                    print(
                        f"  {mbit:g} Mbit/s {rtt:g} ms {v} round {rnd}: {statistics.median(t):.3f} s, load {load:.1f}",
                        file=sys.stderr,
                        flush=True,
                    )
            rows.append({"mbit": mbit, "rtt_ms": rtt, "times": times, "losses": losses})
    return {"window_kib": ns.window_kib, "streams": ns.streams, "rounds": ns.rounds, "steps": ns.steps, "rows": rows}


def joined(raws: list[dict[str, Any]]) -> dict[str, Any]:
    """Raw results of separate invocations (same settings) as one: their rounds' step times together."""
    out = raws[0]
    for raw in raws[1:]:
        assert raw["window_kib"] == out["window_kib"] and raw["streams"] == out["streams"]
        for row, more in zip(out["rows"], raw["rows"], strict=True):
            assert (row["mbit"], row["rtt_ms"]) == (more["mbit"], more["rtt_ms"])
            for v, times in more["times"].items():
                row["times"][v] += times
                assert row["losses"][v] == more["losses"][v], "the same seed and data give the same losses"
        out["rounds"] += raw["rounds"]
    return out


def table(raw: dict[str, Any]) -> tuple[list[str], float, float]:
    """The markdown table of ``raw``: each measured median with the planner's and the simulator's
    prediction next to it; the median relative error of each."""
    variants = [v for v in VARIANTS if v in raw["rows"][0]["times"]]
    pipes = [v for v in variants if v != "geo_sync"]
    cells = " | ".join(f"{v} s (plan / sim)" for v in variants)
    lines = [f"| WAN Mbit/s | RTT ms | {cells} | naive / multi_ts | pipeline losses equal |"]
    lines.append("|" + "---|" * (len(variants) + 4))
    plan_err, sim_err = [], []
    for row in raw["rows"]:
        med = {v: statistics.median(row["times"][v]) for v in variants}
        pred = {v: predicted(v, row["mbit"], row["rtt_ms"], raw["window_kib"], raw["streams"]) for v in variants}
        plan_err += [abs(pred[v][0] - med[v]) / med[v] for v in variants]
        sim_err += [abs(pred[v][1] - med[v]) / med[v] for v in variants]
        same = all(row["losses"][v] == row["losses"][pipes[0]] for v in pipes)
        ratio = f"{med['naive'] / med['multi_ts']:.2f}" if {"naive", "multi_ts"} <= set(variants) else "-"
        figures = " | ".join(f"{med[v]:.3f} ({pred[v][0]:.3f} / {pred[v][1]:.3f})" for v in variants)
        lines.append(f"| {row['mbit']:g} | {row['rtt_ms']:g} | {figures} | {ratio} | {'yes' if same else 'NO'} |")
    return lines, statistics.median(plan_err), statistics.median(sim_err)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbit", default="20,100", help="WAN rates, Mbit/s (comma list)")
    ap.add_argument("--rtt-ms", default="20,80", help="WAN round trips, ms (comma list)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="which of " + ", ".join(VARIANTS))
    ap.add_argument("--streams", type=int, default=4, help="geo.wan_streams of the multi-connection variants")
    ap.add_argument("--window-kib", type=int, default=0, help="TCP window limit in the datacenters (0: autotuned)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--first-round", type=int, default=0, help="number of the first round (sets the order)")
    ap.add_argument("--out", type=Path, help="write the raw results (JSON) here")
    ap.add_argument(
        "--table", type=Path, nargs="+", help="print the table of earlier raw results (their rounds joined)"
    )
    ns = ap.parse_args(argv)
    raw = joined([json.loads(p.read_text()) for p in ns.table]) if ns.table else measure(ns)
    if ns.out:
        ns.out.write_text(json.dumps(raw))
    lines, plan_err, sim_err = table(raw)
    window = f"{raw['window_kib']} KiB" if raw["window_kib"] else "autotuned"
    print(f"TCP window: {window}; geo.wan_streams {raw['streams']}; {raw['rounds']} round(s) of {raw['steps']} steps")
    print("\n".join(lines))
    print(f"median |predicted - measured| / measured: planner {100 * plan_err:.0f}%, simulator {100 * sim_err:.0f}%")
    return 0 if all(line.endswith("| yes |") for line in lines[2:]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
