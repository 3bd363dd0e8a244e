"""Bubble filling across an emulated WAN: busy fraction and step time without and with prefill.

    python benchmarks/bubbles.py                          # 20 Mbit/s, 80 ms RTT, 2 pairs
    python benchmarks/bubbles.py --mbit 100 --rtt-ms 20 --pairs 3
    python benchmarks/bubbles.py --plot docs/img/bubbles.svg   # and one step's timeline, without and with

Every run is a real `isthmus emulate --wan-mbit R --wan-rtt-ms T -- train` (root; network
namespaces, tc tbf, the user-space delay line) on 2 datacenters x 1 CPU rank (a copy of
`emulated-2dc` with one device per datacenter): pp 2 with the stage boundary on the WAN
(`geo.dc_axis = pp`), 1F1B with 4 microbatches, the `tiny` config widened to dim 256 (its stages
wait on the WAN most of each step), global batch 8 x 128. "with" adds `--bubbles.prefill
synthetic:N:LEN` served by the run's own model shape at its initial weights. The runs without and
with filling alternate (off, on, off, on, ...), same seed and data; per run, the step time is the
median of `step_time_s` over steps 3.. (step 1 builds the schedule, step 2 is the first the filler
may fill: it needs two measured gaps per slot) and a rank's busy fraction the median of its `busy`
over the same steps; the table gives the medians over runs. The losses of every run must be equal.
With --plot, the first pair's timelines (`--metrics.timeline`) of one step, the one of median length
among steps 3.., are drawn one above the other: each rank's training ops, waits and prefill chunks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from isthmus.train.short_run import max_steps_override

sys.path.insert(0, str(Path(__file__).resolve().parent))  # plots.py, a sibling

TOPOLOGY = """name = "emulated-2dc-1x1"
description = "2 emulated datacenters x 1 CPU rank"
[devices.cpu-one]
base = "cpu"
description = "one rank per core"
memory_gb = 6
memory_bandwidth_gb_s = 13
peak_tflops = { fp32 = 0.075, bf16 = 0.5 }
kernel_launch_us = 20
[[datacenters]]
name = "dc0"
device = "cpu-one"
nodes = 1
devices_per_node = 1
intra_node = { bandwidth_gb_s = 0.6, latency_us = 200 }
fabric = { bandwidth_gb_s = 0.6, latency_us = 200 }
[[datacenters]]
name = "dc1"
device = "cpu-one"
nodes = 1
devices_per_node = 1
intra_node = { bandwidth_gb_s = 0.6, latency_us = 200 }
fabric = { bandwidth_gb_s = 0.6, latency_us = 200 }
[[wan]]
between = ["dc0", "dc1"]
bandwidth_gb_s = 0.0025
latency_us = 0
"""
TRAIN = [
    "--config",
    "tiny",
    "--model.dim",
    "256",
    "--model.ffn_dim",
    "512",
    "--parallel.pp",
    "2",
    "--parallel.microbatches",
    "4",
    "--geo.datacenters",
    "2",
    "--geo.dc_axis",
    "pp",
    "--train.batch_size",
    "8",
    "--train.seq_len",
    "128",
    "--train.threads",
    "1",
    "--train.val_every",
    "0",
    "--data.max_bytes",
    "200000",
    "--metrics.progress",
    "false",
]


def run(
    topology: Path,
    mbit: float,
    rtt_ms: float,
    steps: int,
    prefill: str,
    out: Path,
    dim: int = 256,
    check_served: bool = True,
) -> dict[str, object]:
    """One emulated run: median step time, each rank's median busy fraction, prefill tokens/s, losses."""
    metrics = out / "metrics.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "isthmus",
        "emulate",
        "--topology",
        str(topology),
        "--wan-mbit",
        f"{mbit:g}",
        "--wan-rtt-ms",
        f"{rtt_ms:g}",
        "--timeout",
        "300",
        "--log-dir",
        str(out / "logs"),
        "--",
        "train",
        *TRAIN,
        "--model.dim",
        str(dim),
        "--train.steps",
        str(steps),
        "--train.run_dir",
        str(out / "run"),
        "--metrics.jsonl",
        str(metrics),
        "--metrics.timeline",
        str(out / "timeline.json"),
        *(["--bubbles.prefill", prefill] if prefill else []),
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({prefill or 'no filling'}):\n{proc.stdout[-3000:]}")
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    timed = records[2:] or records[-1:]  # a short run (ISTHMUS_MAX_STEPS) has no step 3
    step = statistics.median(r["step_time_s"] for r in timed)
    # Wall time per step: between consecutive steps' metrics, so the step's metrics collectives
    # (which `step_time_s` leaves out) are in it too.
    before = records[len(records) - len(timed) - 1 : -1]  # the step before each timed one
    wall = statistics.median([b["elapsed_s"] - a["elapsed_s"] for a, b in zip(before, timed, strict=False)] or [0.0])
    busy = [statistics.median(r["busy"][k] for r in timed) for k in range(len(timed[0]["busy"]))]
    tokens = sum(r.get("prefill_tokens", 0) for r in timed) / sum(r["step_time_s"] for r in timed)
    return {
        "timeline": one_step(out / "timeline.json", timed),
        "step_s": step,
        "wall_step_s": wall,
        "served_equal_alone": served_equal_alone(out / "run") if prefill and check_served else None,
        "busy": busy,
        "prefill_tok_s": tokens,
        "losses": [r["loss"] for r in records],
        "wall_s": time.perf_counter() - start,
    }


def one_step(trace: Path, timed: list[dict[str, Any]]) -> dict[str, Any]:
    """The events of one timed step from a run's timeline: the step whose window on rank 0 has the
    median length; per rank, (category, start, end) in seconds from that rank's window start."""
    events = json.loads(trace.read_text())["traceEvents"]
    windows = {
        (e["pid"], int(e["name"].split()[1])): (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "step"
    }
    steps = sorted((w[1] - w[0], step) for (pid, step), w in windows.items() if pid == 1 and step >= timed[0]["step"])
    step = steps[len(steps) // 2][1]
    ranks: dict[str, list[tuple[str, float, float]]] = {}
    for pid in sorted({pid for pid, _ in windows}):
        start, end = windows[(pid, step)]
        ranks[str(pid - 1)] = [
            (e["cat"], (max(e["ts"], start) - start) / 1e6, (min(e["ts"] + e["dur"], end) - start) / 1e6)
            for e in events
            if e.get("ph") == "X" and e["cat"] != "step" and e["ts"] < end and e["ts"] + e["dur"] > start
        ]
    busy = next(r["busy"] for r in timed if r["step"] == step)
    return {"step": step, "ranks": ranks, "busy": busy}


def plot(without: dict[str, Any], with_: dict[str, Any], title: str, path: str) -> None:
    """One step of a run without filling above one of a run with it: per rank, a row of training ops
    and waits and a row of prefill chunks."""
    import plots

    plt = plots.pyplot()
    if plt is None:
        return
    # Waits first, so that the training ops a wait encloses (the filler's chunks run inside it) stay on top.
    colors = {"wait": "0.88", "forward": "#1f77b4", "backward": "#ff7f0e", "optimizer": "#9467bd", "prefill": "#2ca02c"}
    fig, axes = plt.subplots(2, 1, figsize=(9, 4.2), sharex=True)
    for ax, (name, tl) in zip(axes, (("without filling", without), ("with filling", with_))):
        labels = []
        for rank, spans in tl["ranks"].items():
            y = 2 * (len(tl["ranks"]) - 1 - int(rank))
            for cat, color in colors.items():
                row = y if cat == "prefill" else y + 1
                bars = [(a, b - a) for c, a, b in spans if c == cat]
                ax.broken_barh(bars, (row + 0.1, 0.8), color=color, label=cat if rank == "0" else None)
            labels += [(y + 0.5, f"rank {rank} prefill"), (y + 1.5, f"rank {rank} training")]
        ax.set_yticks([v for v, _ in labels], [t for _, t in labels], fontsize=7)
        busy = ", ".join(f"{b:.0%}" for b in tl["busy"])
        ax.set_title(f"{name}: step {tl['step']}, busy per rank {busy}", fontsize=9)
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    axes[1].set_xlabel("seconds into the step (each rank's own step window)")
    fig.suptitle(title, fontsize=9)
    plots.save(fig, path)


def served_equal_alone(run_dir: Path) -> dict[str, int]:
    """Every request the run served (its prefill.jsonl) against the same prefill run alone, outside
    training (`isthmus.serve.prefill.prefill_alone`)."""
    from isthmus.serve.prefill import prefill_alone

    served = [json.loads(line) for line in (run_dir / "prefill.jsonl").read_text().splitlines()]
    alone = prefill_alone(run_dir)
    keys = ("next_token", "logits_sha256")
    equal = sum(all(r[k] == alone[r["id"]][k] for k in keys) for r in served)
    return {"equal": equal, "served": len(served), "in_bubbles": sum(r["step"] is not None for r in served)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbit", type=float, default=20.0, help="WAN rate, Mbit/s")
    ap.add_argument("--rtt-ms", type=float, default=80.0, help="WAN round trip, ms")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=2, help="runs without and with filling, alternated")
    ap.add_argument(
        "--prefill",
        default="synthetic:8000:32",
        help="bubbles.prefill of the runs with filling (enough that the bubbles never run dry while measured)",
    )
    ap.add_argument("--plot", default="", help="also draw one step's timeline without and with filling (.svg, .png)")
    ns = ap.parse_args(argv)
    if max_steps_override() is not None:
        # A smoke run (ISTHMUS_MAX_STEPS, as the docs' test runs it): one pair, few requests, whose
        # serving after training and again alone takes seconds; the figures then mean nothing.
        ns.pairs, ns.prefill = 1, "synthetic:200:32"
    load_before = os.getloadavg()
    got: dict[str, list[dict[str, object]]] = {"without": [], "with": []}
    with tempfile.TemporaryDirectory() as tmp:
        topology = Path(tmp) / "emulated-2dc-1x1.toml"
        topology.write_text(TOPOLOGY)
        for i in range(ns.pairs):
            for name, prefill in (("without", ""), ("with", ns.prefill)):
                r = run(topology, ns.mbit, ns.rtt_ms, ns.steps, prefill, Path(tmp) / f"{name}-{i}")
                got[name].append(r)
                shown = {k: v for k, v in r.items() if k not in ("losses", "timeline")}
                print(f"  {name} #{i}: {json.dumps(shown)}", file=sys.stderr)
    load_after = os.getloadavg()
    same = all(r["losses"] == got["without"][0]["losses"] for rs in got.values() for r in rs)

    def med(name: str, key: str) -> float:
        return statistics.median(float(r[key]) for r in got[name])  # type: ignore[arg-type]

    def busy(name: str) -> list[float]:
        n = len(got[name][0]["busy"])  # type: ignore[arg-type]
        return [statistics.median(r["busy"][k] for r in got[name]) for k in range(n)]  # type: ignore[index]

    off, on = med("without", "step_s"), med("with", "step_s")
    print(
        f"WAN {ns.mbit:g} Mbit/s, RTT {ns.rtt_ms:g} ms; {ns.pairs} pair(s); load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    print("| filling | step s | wall s per step | busy per rank | prefill tokens/s |")
    print("|---|---|---|---|---|")
    for name, label in (("without", "without"), ("with", f"with ({ns.prefill})")):
        print(
            f"| {label} | {med(name, 'step_s'):.3f} | {med(name, 'wall_step_s'):.3f} "
            f"| {', '.join(f'{b:.0%}' for b in busy(name))} | {med(name, 'prefill_tok_s'):.0f} |"
        )
    wall = med("with", "wall_step_s") / (med("without", "wall_step_s") or float("nan"))  # nan: a one-step run
    print(
        f"step time with / without: {on / off:.3f} (wall per step {wall:.3f}); losses equal: {'yes' if same else 'NO'}"
    )
    if ns.plot:
        title = (
            f"pp 2 across a {ns.mbit:g} Mbit/s, {ns.rtt_ms:g} ms WAN, 1F1B x 4 microbatches, 1 CPU rank per datacenter"
        )
        plot(got["without"][0]["timeline"], got["with"][0]["timeline"], title, ns.plot)  # type: ignore[arg-type]
    checks: list[dict[str, int]] = [r["served_equal_alone"] for r in got["with"]]  # type: ignore[misc]
    print(
        "served outputs equal to the same prefill run alone: "
        + "; ".join(f"{c['equal']} of {c['served']} ({c['in_bubbles']} in bubbles)" for c in checks)
    )
    return 0 if same and all(c["equal"] == c["served"] for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
