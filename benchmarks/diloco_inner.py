"""DiLoCo's inner steps across an emulated WAN against the same run on this machine's loopback.

    python benchmarks/diloco_inner.py                      # 20 Mbit/s, 80 ms RTT, 2 pairs of runs

Under DiLoCo an inner step should never touch the WAN (docs/datacenters.md): its step time across
a slow, distant link should be the step time without one. Each pair is two runs of the same
command, `train --geo.sync diloco --geo.inner_steps H` with `tiny`, 2 datacenters x 2 CPU ranks:
one under `isthmus emulate --topology emulated-2dc --wan-mbit R --wan-rtt-ms T` (root; network
namespaces, tc, the user-space delay line), one as local ranks on loopback (`--geo.datacenters 2`,
no emulated WAN); the pairs alternate which runs first. Read back from each run's metrics JSONL
(`step_time_s`, rank 0): the inner steps' mean and median (every step but the first, which warms
up, and the outer syncs, every H-th), and the outer syncs' mean apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from isthmus.train.short_run import capped, max_steps_override


def _run(emulated: bool, ns: argparse.Namespace, out: Path) -> list[dict[str, float]]:
    metrics = out / "metrics.jsonl"
    train = [
        "train",
        "--model.flavor",
        ns.flavor,
        "--parallel.nproc",
        "4",
        "--geo.sync",
        "diloco",
        "--geo.inner_steps",
        str(ns.inner_steps),
        "--train.steps",
        str(capped(ns.steps)),
        "--train.batch_size",
        "16",
        "--train.seq_len",
        "128",
        "--train.val_every",
        "0",
        "--train.run_dir",
        str(out / "run"),
        "--metrics.jsonl",
        str(metrics),
        "--metrics.progress",
        "false",
    ]
    if emulated:
        wan = ["--topology", "emulated-2dc", "--wan-mbit", f"{ns.wan_mbit:g}", "--wan-rtt-ms", f"{ns.wan_rtt_ms:g}"]
        cmd = [sys.executable, "-m", "isthmus", "emulate", *wan, "--timeout", "600", "--", *train]
    else:
        cmd = [sys.executable, "-m", "isthmus", *train, "--geo.datacenters", "2"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[2:])} failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "step_time_s" in r]


def _summary(records: list[dict[str, float]], h: int) -> tuple[list[float], list[float]]:
    """(inner steps' times, outer syncs' times)."""
    inner = [r["step_time_s"] for r in records if r["step"] > 1 and r["step"] % h]
    outer = [r["step_time_s"] for r in records if r["step"] % h == 0]
    return inner, outer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=61)
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--flavor", default="tiny")
    ap.add_argument("--wan-mbit", type=float, default=20)
    ap.add_argument("--wan-rtt-ms", type=float, default=80)
    ap.add_argument("--pairs", type=int, default=2)
    ns = ap.parse_args()
    pairs = 1 if max_steps_override() is not None else ns.pairs  # the docs' short run: one pair
    times: dict[str, tuple[list[float], list[float]]] = {"loopback": ([], []), "emulated WAN": ([], [])}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(pairs):
            order = [False, True] if pair % 2 == 0 else [True, False]
            for emulated in order:
                name = "emulated WAN" if emulated else "loopback"
                inner, outer = _summary(_run(emulated, ns, Path(tmp) / f"{pair}-{name}"), ns.inner_steps)
                times[name][0].extend(inner)
                times[name][1].extend(outer)
    wan = f"{ns.wan_mbit:g} Mbit/s, {ns.wan_rtt_ms:g} ms RTT"
    print(f"diloco, {ns.flavor}, H = {ns.inner_steps}, {capped(ns.steps)} steps x {pairs} pair(s); WAN {wan}")
    print(f"{'run':<14} {'inner mean s':>12} {'inner median s':>14} {'outer sync s':>12}")
    for name, (inner, outer) in times.items():
        cells = [f"{statistics.mean(x):.4f}" if x else "-" for x in (inner, outer)]
        median = f"{statistics.median(inner):.4f}" if inner else "-"
        print(f"{name:<14} {cells[0]:>12} {median:>14} {cells[1]:>12}")
    (lan, _), (across, _) = times["loopback"], times["emulated WAN"]
    if lan and across:
        print(
            f"inner step across the WAN / loopback: mean {statistics.mean(across) / statistics.mean(lan):.3f}, "
            f"median {statistics.median(across) / statistics.median(lan):.3f}"
        )


if __name__ == "__main__":
    main()
