"""Bubble filling across WAN rates and round trips: step time, busy time and prefill per point.

    python benchmarks/bubbles_sweep.py                      # 20, 100, 1000 Mbit/s x 10, 100 ms, 2 pairs
    python benchmarks/bubbles_sweep.py --mbit 100 --rtt-ms 80 --pairs 3
    python benchmarks/bubbles_sweep.py --plot docs/img/bubbles_sweep.svg

The runs of `benchmarks/bubbles.py` (root; `isthmus emulate`, 2 datacenters x 1 CPU rank, pp 2 with
the stage boundary on the WAN, 1F1B x 4 microbatches, batch 8 x 128), with `tiny` widened to dim
192, at every (rate, RTT) point: without and with `--bubbles.prefill`, alternated in pairs within
the point. Per point: the step ratio with / without (medians over runs of each run's median step,
steps 3..), its noise (the spread of the per-pair ratios), the least busy rank's busy fraction,
prefill tokens/s in bubbles, the load average, and where the time of a filled step goes, in ms per
step and rank, from the runs' timelines: chunks running past a transfer's completion (overrun), the
waiter thread's hand-off back to the schedule (wake), training ops slower than unfilled (compute),
and the WAN delay line's time waiting for a CPU (run queue, from /proc schedstat), filled minus
unfilled. The first point's first filled run's outputs are checked against the same prefill alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bubbles.py, plots.py: siblings

import bubbles
from isthmus.train.short_run import max_steps_override

COMPUTE = ("forward", "backward", "optimizer")


class RunQueueProbe:
    """Samples the run-queue wait (and CPU time) of this process's `isthmus.launch.delayline`
    descendants from /proc/PID/task/TID/schedstat while a run goes on; the last sample of each
    thread counts, so up to one period at its end is missed."""

    def __init__(self, period_s: float = 0.25) -> None:
        self.period_s = period_s
        self.seen: dict[tuple[int, int], tuple[int, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> RunQueueProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def totals_s(self) -> tuple[float, float]:
        """(on-CPU seconds, run-queue wait seconds) over every thread seen."""
        return sum(v[0] for v in self.seen.values()) / 1e9, sum(v[1] for v in self.seen.values()) / 1e9

    def _loop(self) -> None:
        me = os.getpid()
        while not self._stop.wait(self.period_s):
            for pid in _delay_lines(me):
                try:
                    for tid in os.listdir(f"/proc/{pid}/task"):
                        run_ns, wait_ns, _ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
                        self.seen[(pid, int(tid))] = (int(run_ns), int(wait_ns))
                except (OSError, ValueError):
                    continue  # it ended between the listing and the read


def _delay_lines(ancestor: int) -> list[int]:
    parents: dict[int, int] = {}
    lines = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            if b"isthmus.launch.delayline" in Path(f"/proc/{entry}/cmdline").read_bytes():
                lines.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    out = []
    for pid in lines:
        p = pid
        while p > 1 and p != ancestor:
            p = parents.get(p, 0)
        if p == ancestor:
            out.append(pid)
    return out


def breakdown(trace: Path, first_step: int) -> dict[str, float]:
    """Per step and rank (medians over steps >= ``first_step`` and ranks), in ms: filled waits'
    overrun past completion, the part of it a chunk ran past, the hand-off, training ops, the
    waits' gaps; and over all chunks in those steps, actual / predicted cost (median, max)."""
    events = json.loads(trace.read_text())["traceEvents"]
    xs = [e for e in events if e.get("ph") == "X"]
    per: dict[str, list[float]] = {k: [] for k in ("overrun", "chunk_overrun", "wake", "compute", "gap")}
    ratios: list[float] = []
    for pid in sorted({e["pid"] for e in xs}):
        steps = [e for e in xs if e["pid"] == pid and e["cat"] == "step" and int(e["name"].split()[1]) >= first_step]
        for s in steps:
            inside = [e for e in xs if e["pid"] == pid and s["ts"] <= e["ts"] < s["ts"] + s["dur"]]
            waits = [e for e in inside if e["cat"] == "wait"]
            per["overrun"].append(sum(e["args"].get("overrun_ms") or 0 for e in waits))
            per["chunk_overrun"].append(sum(e["args"].get("chunk_overrun_ms") or 0 for e in waits))
            per["wake"].append(sum(e["args"].get("wake_ms") or 0 for e in waits))
            per["gap"].append(sum(e["args"].get("gap_ms") or 0 for e in waits))
            per["compute"].append(sum(e["dur"] for e in inside if e["cat"] in COMPUTE) / 1e3)
            ratios += [
                e["dur"] / 1e3 / e["args"]["predicted_ms"]
                for e in inside
                if e["cat"] == "prefill" and e["args"].get("predicted_ms")
            ]
    out = {k: statistics.median(v) if v else 0.0 for k, v in per.items()}
    out["cost_over_predicted_median"] = statistics.median(ratios) if ratios else 0.0
    out["cost_over_predicted_max"] = max(ratios, default=0.0)
    return out


def filled_vs_unfilled(metrics: Path) -> float:
    """Within one run with filling: median time of the steps that served prefill over that of the
    steps (after the first) that served none (the filler's probes, and steps where nothing fit), so
    that load from outside the run, which drifts between runs, weighs on both alike."""
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "step_time_s" in r]
    filled = [r["step_time_s"] for r in records[1:] if r.get("prefill_tokens")]
    unfilled = [r["step_time_s"] for r in records[1:] if not r.get("prefill_tokens")]
    return statistics.median(filled) / statistics.median(unfilled) if filled and unfilled else float("nan")


def measure(
    topology: Path, mbit: float, rtt_ms: float, ns: argparse.Namespace, out: Path, filled: bool, check: bool
) -> dict[str, Any]:
    with RunQueueProbe() as probe:
        r = bubbles.run(
            topology,
            mbit,
            rtt_ms,
            ns.steps,
            ns.prefill if filled else "",
            out,
            dim=ns.dim,
            check_served=check,
        )
    cpu_s, queue_s = probe.totals_s()
    r.pop("timeline")
    r["breakdown"] = breakdown(out / "timeline.json", first_step=3)
    r["filled_vs_unfilled"] = filled_vs_unfilled(out / "metrics.jsonl") if filled else None
    r["delay_line_cpu_ms_per_step"] = 1e3 * cpu_s / ns.steps
    r["delay_line_queue_ms_per_step"] = 1e3 * queue_s / ns.steps
    r["load"] = Path("/proc/loadavg").read_text().split()[0]
    return r


def point(topology: Path, mbit: float, rtt_ms: float, ns: argparse.Namespace, tmp: Path, check: bool) -> dict[str, Any]:
    got: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for i in range(ns.pairs):
        for name in ("off", "on"):
            r = measure(
                topology, mbit, rtt_ms, ns, tmp / f"{mbit:g}-{rtt_ms:g}-{name}{i}", name == "on", check and i == 0
            )
            got[name].append(r)
            shown = {k: v for k, v in r.items() if k != "losses"}
            print(f"  {mbit:g} Mbit/s {rtt_ms:g} ms {name} #{i}: {json.dumps(shown)}", file=sys.stderr, flush=True)

    def med(name: str, key: str) -> float:
        return statistics.median(float(r[key]) for r in got[name])

    def med_b(name: str, key: str) -> float:
        return statistics.median(float(r["breakdown"][key]) for r in got[name])

    pair_ratios = [b["step_s"] / a["step_s"] for a, b in zip(got["off"], got["on"], strict=True)]
    off_ratios = [r["step_s"] / got["off"][0]["step_s"] for r in got["off"]]
    check = got["on"][0]["served_equal_alone"]
    return {
        "mbit": mbit,
        "rtt_ms": rtt_ms,
        "step_off_s": med("off", "step_s"),
        "step_on_s": med("on", "step_s"),
        "ratio": med("on", "step_s") / med("off", "step_s"),
        "pair_ratios": pair_ratios,
        "in_run": med("on", "filled_vs_unfilled"),
        "off_spread": max(off_ratios) - min(off_ratios),
        "busy_off": min(statistics.median(r["busy"][k] for r in got["off"]) for k in range(2)),
        "busy_on": min(statistics.median(r["busy"][k] for r in got["on"]) for k in range(2)),
        "prefill_tok_s": med("on", "prefill_tok_s"),
        "overrun_ms": med_b("on", "overrun"),
        "chunk_overrun_ms": med_b("on", "chunk_overrun"),
        "wake_ms": med_b("on", "wake"),
        "compute_delta_ms": med_b("on", "compute") - med_b("off", "compute"),
        "gap_delta_ms": med_b("on", "gap") - med_b("off", "gap"),
        "cost_over_predicted": (med_b("on", "cost_over_predicted_median"), med_b("on", "cost_over_predicted_max")),
        "queue_delta_ms": med("on", "delay_line_queue_ms_per_step") - med("off", "delay_line_queue_ms_per_step"),
        "queue_off_ms": med("off", "delay_line_queue_ms_per_step"),
        "line_cpu_ms": med("off", "delay_line_cpu_ms_per_step"),
        "losses_equal": all(r["losses"] == got["off"][0]["losses"] for rs in got.values() for r in rs),
        "served": check,
        "load": "/".join(r["load"] for rs in zip(got["off"], got["on"], strict=True) for r in rs),
    }


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Step ratio (left) and the least busy rank's busy fraction without and with filling (right)
    against the WAN rate, one line per RTT."""
    import plots

    plt = plots.pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for rtt, color in zip(sorted({r["rtt_ms"] for r in rows}), ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")):
        mine = sorted((r for r in rows if r["rtt_ms"] == rtt), key=lambda r: r["mbit"])
        x = [r["mbit"] for r in mine]
        left.plot(x, [r["ratio"] for r in mine], "o-", color=color, label=f"RTT {rtt:g} ms")
        right.plot(x, [r["busy_on"] for r in mine], "o-", color=color, label=f"with filling, RTT {rtt:g} ms")
        right.plot(x, [r["busy_off"] for r in mine], "o--", color=color, alpha=0.5, label=f"without, RTT {rtt:g} ms")
    left.axhline(1.0, color="0.5", lw=0.8)
    left.set_ylabel("step time with / without filling")
    right.set_ylabel("busy fraction, least busy rank")
    right.set_ylim(0, 1)
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("WAN Mbit/s")
        ax.legend(fontsize=7, frameon=False)
    fig.suptitle("pp 2 across an emulated WAN, 1 CPU rank per datacenter, tiny at dim 192", fontsize=9)
    fig.tight_layout()
    plots.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbit", default="20,100,1000", help="WAN rates, Mbit/s, comma-separated")
    ap.add_argument("--rtt-ms", default="10,100", help="WAN round trips, ms, comma-separated")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=2, help="runs without and with filling per point, alternated")
    ap.add_argument("--dim", type=int, default=192, help="model.dim of the trained (and serving) model")
    ap.add_argument("--prefill", default="synthetic:2000:32", help="bubbles.prefill of the runs with filling")
    ap.add_argument("--plot", default="", help="draw the step ratio and busy fraction per point (.svg, .png)")
    ap.add_argument("--json", default="", help="also write the rows here")
    ap.add_argument("--keep", default="", help="keep every run's directory (metrics, timeline) under this folder")
    ns = ap.parse_args(argv)
    if max_steps_override() is not None:  # a smoke run: one point, one pair, few requests
        ns.mbit, ns.rtt_ms, ns.pairs, ns.prefill = "100", "10", 1, "synthetic:200:32"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(ns.keep or tmp)
        runs.mkdir(parents=True, exist_ok=True)
        topology = runs / "emulated-2dc-1x1.toml"
        topology.write_text(bubbles.TOPOLOGY)
        for mbit in (float(v) for v in ns.mbit.split(",")):
            for rtt in (float(v) for v in ns.rtt_ms.split(",")):
                rows.append(point(topology, mbit, rtt, ns, runs, check=not rows))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{ns.pairs} pair(s) per point, {ns.steps} steps, {ns.prefill}; ms per step and rank, filled")
    print(
        "| WAN | RTT | step s without / with | with / without (pairs) | filled / unfilled steps "
        "| least busy without / with "
        "| prefill tok/s | overrun (chunk, wake) ms | compute +ms | delay line queue +ms | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pairs = ", ".join(f"{x:.3f}" for x in r["pair_ratios"])
        print(
            f"| {r['mbit']:g} Mbit/s | {r['rtt_ms']:g} ms | {r['step_off_s']:.3f} / {r['step_on_s']:.3f} "
            f"| {r['ratio']:.3f} ({pairs}) | {r['in_run']:.3f} | {r['busy_off']:.0%} / {r['busy_on']:.0%} | {r['prefill_tok_s']:.0f} "
            f"| {r['overrun_ms']:.1f} ({r['chunk_overrun_ms']:.1f}, {r['wake_ms']:.1f}) "
            f"| {r['compute_delta_ms']:+.1f} | {r['queue_delta_ms']:+.1f} | {r['load']} |"
        )
    ok = all(r["losses_equal"] for r in rows) and all(
        r["served"] is None or r["served"]["equal"] == r["served"]["served"] for r in rows
    )
    print("losses equal in every run, served outputs equal to the prefill alone: " + ("yes" if ok else "NO"))
    if ns.plot:
        plot(rows, ns.plot)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
