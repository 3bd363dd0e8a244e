"""A pipeline across two emulated datacenters: one WAN connection per transfer against several.

    python benchmarks/wan_pipeline.py                   # 20/100 Mbit/s x 20/80 ms, 1 vs 4 streams
    python benchmarks/wan_pipeline.py --window-kib 64   # every TCP window limited to 64 KiB
    python benchmarks/wan_pipeline.py --mbit 20 --rtt-ms 80 --streams 1,4,8

Every run is a real `isthmus emulate --topology emulated-2dc --wan-mbit R --wan-rtt-ms T -- train`
(root; network namespaces, tc tbf, the user-space delay line; with --window-kib, `--wan-window-kib`
limits every TCP window, so one flow carries at most window / RTT), the `small` flavor, 2 datacenters x 2
CPU ranks: pp 2 with the stage boundary on the WAN (`geo.dc_axis = pp`), 2 pipelines (dp_replicate
2) whose activations and gradients cross the same link, 1F1B with 4 microbatches, global batch
16 x 128. Each setting runs once per stream count, in turns, with the same seed and data; the step
time is the median of rank 0's `step_time_s` over steps 2.. (step 1 builds the schedule). The losses
of every run at one setting must be equal (striping moves bytes only). "Predicted" is
`isthmus.planner.estimate` for the same layout on `emulated-2dc` with the WAN set to the rate and
latency (one connection: the planner does not model TCP windows).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from isthmus.layout.spec import LayoutSpec
from isthmus.models.flavors import get_flavor
from isthmus.planner.cost import estimate
from isthmus.planner.layout import RUNTIMES, Workload
from isthmus.planner.topology import load_topology

FLAVOR, BATCH, SEQ, MICROBATCHES = "small", 16, 128, 4


def run(mbit: float, rtt_ms: float, window_kib: int, streams: int, steps: int, out: Path) -> tuple[float, list[float]]:
    """(median step seconds from step 2 on, the losses) of one emulated run."""
    metrics = out / "metrics.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "isthmus",
        "emulate",
        "--topology",
        "emulated-2dc",
        "--wan-mbit",
        f"{mbit:g}",
        "--wan-rtt-ms",
        f"{rtt_ms:g}",
        "--wan-window-kib",
        str(window_kib),
        "--timeout",
        "600",
        "--log-dir",
        str(out / "logs"),
        "--",
        "train",
        "--model.flavor",
        FLAVOR,
        "--parallel.nproc",
        "4",
        "--parallel.pp",
        "2",
        "--parallel.dp_replicate",
        "2",
        "--parallel.microbatches",
        str(MICROBATCHES),
        "--geo.datacenters",
        "2",
        "--geo.dc_axis",
        "pp",
        "--geo.wan_streams",
        str(streams),
        "--train.batch_size",
        str(BATCH),
        "--train.seq_len",
        str(SEQ),
        "--train.steps",
        str(steps),
        "--train.val_every",
        "0",
        "--train.run_dir",
        str(out / "run"),
        "--metrics.jsonl",
        str(metrics),
        "--metrics.progress",
        "false",
    ]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{mbit:g} Mbit/s, {rtt_ms:g} ms, {streams} stream(s) failed:\n{proc.stdout[-3000:]}")
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    return statistics.median(r["step_time_s"] for r in records[1:]), [r["loss"] for r in records]


def predicted(mbit: float, rtt_ms: float) -> float:
    topo = load_topology("emulated-2dc").with_wan(bandwidth_gb_s=mbit / 8 / 1000, latency_us=rtt_ms * 1000 / 2)
    lay = LayoutSpec(
        pp=2,
        dp_replicate=2,
        microbatches=MICROBATCHES,
        micro_batch=BATCH // (2 * MICROBATCHES),
        datacenters=2,
        dc_axis="pp",
    )
    work = Workload(get_flavor(FLAVOR), BATCH, SEQ, "fp32")
    return estimate(work, topo, lay, RUNTIMES["isthmus"]).step_time_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbit", default="20,100", help="WAN rates, Mbit/s (comma list)")
    ap.add_argument("--rtt-ms", default="20,80", help="WAN round trips, ms (comma list)")
    ap.add_argument("--streams", default="1,4", help="geo.wan_streams values (comma list; the first is the baseline)")
    ap.add_argument("--window-kib", type=int, default=0, help="TCP window limit in the datacenters (0: autotuned)")
    ap.add_argument("--steps", type=int, default=6)
    ns = ap.parse_args(argv)
    streams = [int(s) for s in ns.streams.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mbit in (float(x) for x in ns.mbit.split(",")):
            for rtt in (float(x) for x in ns.rtt_ms.split(",")):
                got = {
                    s: run(mbit, rtt, ns.window_kib, s, ns.steps, Path(tmp) / f"{mbit:g}-{rtt:g}-{s}") for s in streams
                }
                same = all(losses == got[streams[0]][1] for _, losses in got.values())
                rows.append((mbit, rtt, {s: t for s, (t, _) in got.items()}, same, predicted(mbit, rtt)))
                print(f"  {mbit:g} Mbit/s {rtt:g} ms: {got}", file=sys.stderr, flush=True)
    base = streams[0]
    head = " | ".join(f"{s} stream(s) s" for s in streams)
    ratios = " | ".join(f"{base} / {s}" for s in streams[1:])
    window = f"{ns.window_kib} KiB" if ns.window_kib else "autotuned"
    print(f"TCP window: {window}")
    print(f"| WAN Mbit/s | RTT ms | {head} | {ratios} | losses equal | predicted s (1 stream) |")
    print("|" + "---|" * (4 + 2 * len(streams) - 1))
    for mbit, rtt, times, same, pred in rows:
        cells = " | ".join(f"{times[s]:.3f}" for s in streams)
        rs = " | ".join(f"{times[base] / times[s]:.2f}" for s in streams[1:])
        print(f"| {mbit:g} | {rtt:g} | {cells} | {rs} | {'yes' if same else 'NO'} | {pred:.3f} |")
    return 0 if all(r[3] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
