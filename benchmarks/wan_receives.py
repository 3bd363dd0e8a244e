"""A pipeline across the WAN against the same pipeline on the LAN: receives posted on use, in turn, or ahead.

    python benchmarks/wan_receives.py --mbit 100 --batches 16,64 --out recv.json --plot docs/img/wan_receives.svg
    python benchmarks/wan_receives.py --table recv.json more.json --plot docs/img/wan_receives.svg

The layout of benchmarks/pp_compression.py (`small`, 2 datacenters x 2 CPU ranks, pp 2 with the stage
boundary on the WAN, 2 pipelines sharing the link, 4 microbatches, TCP windows held to 64 KiB,
`geo.wan_streams 4`) with int8 boundaries (`--method`; the method whose loss stays within 1% of
exact at both seeds there), at each global batch of ``--batches`` x 128 tokens. Variants:

- lan: the same command as local ranks on loopback (no emulated WAN), under 1F1B and under GPipe;
- on_use: fair sharing, each receive posted when the schedule reaches it (every message waits a
  round trip for its receiver's notice: gloo writes a payload only against a posted receive);
- time_shared: the pipelines take the link in turn (each receive posted on its turn);
- ahead: fair sharing with `geo.pp_early_recv`, every receive of the step posted when its first is
  asked for, under 1F1B and under GPipe.

A run's step time is the median of rank 0's `step_time_s` over steps 3..; each variant runs once
per round, the order alternating between rounds; the ratio is the WAN step over the LAN step of the
same schedule, measured in the same invocation. The losses of all variants of one batch are equal
(where a receive is posted moves no byte): the script checks it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # pp_compression.py and plots.py, siblings

from isthmus.train.short_run import capped  # noqa: E402
from plots import pyplot, save  # noqa: E402
from pp_compression import PIPELINE, STREAMS, WINDOW_KIB, method_flags, train  # noqa: E402

VARIANTS: dict[str, tuple[bool, str, list[str]]] = {
    # name: (across the WAN, pp_schedule, flags)
    "lan 1f1b": (False, "1f1b", []),
    "lan gpipe": (False, "gpipe", []),
    "on_use 1f1b": (True, "1f1b", []),
    "time_shared 1f1b": (True, "1f1b", ["--geo.wan_schedule", "time_shared"]),
    "ahead 1f1b": (True, "1f1b", ["--geo.pp_early_recv", "true"]),
    "ahead gpipe": (True, "gpipe", ["--geo.pp_early_recv", "true"]),
}


def run(ns: argparse.Namespace) -> dict[str, Any]:
    """Every variant at every batch, ``ns.rounds`` times, alternating the order."""
    steps = capped(ns.steps)
    got: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(capped(ns.rounds)):
            for batch in [int(b) for b in ns.batches.split(",")]:
                chosen = [n for n in VARIANTS if not ns.variants or n in ns.variants.split(",")]
                names = chosen if rnd % 2 == 0 else chosen[::-1]
                for name in names:
                    wan, schedule, extra = VARIANTS[name]
                    out = Path(tmp) / f"{batch}-{name.replace(' ', '_')}-{rnd}"
                    flags = [*PIPELINE, "--geo.wan_streams", str(STREAMS), *method_flags(ns.method), *extra]
                    flags += ["--parallel.pp_schedule", schedule, "--train.val_batches", "1"]
                    flags += ["--parallel.microbatches", str(ns.microbatches)]  # after train()'s own: it wins
                    records = [
                        r
                        for r in train(out, flags, 4, steps, ns.mbit if wan else None, batch, ns.window_kib)
                        if "loss" in r
                    ]
                    timed = records[2:] or records[-1:]
                    row = {
                        "step_s": statistics.median(r["step_time_s"] for r in timed),
                        "losses": [r["loss"] for r in records],
                        "load": os.getloadavg()[0],
                    }
                    got.setdefault(str(batch), {}).setdefault(name, []).append(row)
                    print(f"  batch {batch} {name} round {rnd}: {row['step_s']:.3f} s", file=sys.stderr, flush=True)
    return {
        "mbit": ns.mbit,
        "method": ns.method,
        "window_kib": ns.window_kib,
        "microbatches": ns.microbatches,
        "steps": steps,
        "runs": got,
    }


def joined(raws: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {**raws[0], "runs": {}}
    for raw in raws:
        for batch, variants in raw["runs"].items():
            for name, rows in variants.items():
                out["runs"].setdefault(batch, {}).setdefault(name, []).extend(rows)
    return out


def medians(raw: dict[str, Any]) -> dict[str, dict[str, float]]:
    return {
        b: {n: statistics.median(r["step_s"] for r in rows) for n, rows in v.items()} for b, v in raw["runs"].items()
    }


def present(raw: dict[str, Any]) -> list[str]:
    """The WAN variants run at every batch of ``raw``, in VARIANTS' order."""
    ran = [set(v) for v in raw["runs"].values()]
    return [n for n in VARIANTS if not n.startswith("lan") and all(n in r for r in ran)]


def ratio(med: dict[str, float], name: str) -> float:
    """A variant's step over the LAN step of its schedule."""
    return med[name] / med[f"lan {name.split()[-1]}"]


def table(raw: dict[str, Any]) -> list[str]:
    med = medians(raw)
    names = present(raw)
    window = raw.get("window_kib", WINDOW_KIB)
    windows = f"TCP windows {window} KiB" if window else "autotuned TCP windows"
    lines = [f"{raw['method']} boundaries, {raw['mbit']:g} Mbit/s, 80 ms RTT, {windows}: step s (WAN / LAN)"]
    lines += ["", "| batch x 128 | lan 1f1b | lan gpipe | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 3)]
    for batch in sorted(med, key=int):
        m = med[batch]
        cells = " | ".join(f"{m[n]:.3f} ({ratio(m, n):.2f})" for n in names)
        lines.append(f"| {batch} | {m['lan 1f1b']:.3f} | {m.get('lan gpipe', float('nan')):.3f} | {cells} |")
        losses = {tuple(r["losses"]) for rows in raw["runs"][batch].values() for r in rows}
        assert len(losses) == 1, f"batch {batch}: the variants' losses differ"
    loads = [r["load"] for v in raw["runs"].values() for rows in v.values() for r in rows]
    lines.append(
        f"\nload average (1 min) during the runs: {min(loads):.1f}-{max(loads):.1f}; losses equal across variants"
    )
    return lines


def plot(raw: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    med = medians(raw)
    names = present(raw)
    batches = sorted(med, key=int)
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    width = 0.8 / len(batches)
    for i, batch in enumerate(batches):
        xs = [j + (i - (len(batches) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, [ratio(med[batch], n) for n in names], width, label=f"batch {batch} x 128")
    ax.axhline(1.15, color="grey", ls="--", lw=0.8)
    ax.text(len(names) - 0.5, 1.17, "LAN + 15%", ha="right", fontsize=8, color="grey")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("WAN step / LAN step (same schedule)")
    ax.set_title(f"pp 2 across {raw['mbit']:g} Mbit/s, 80 ms: where receives are posted ({raw['method']})")
    ax.legend(fontsize=8)
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbit", type=float, default=100.0, help="WAN rate, Mbit/s (RTT 80 ms)")
    ap.add_argument("--batches", default="16,64", help="global batch sizes, sequences of 128 tokens (comma list)")
    ap.add_argument("--method", default="int8", help="geo.pp_compression of every variant")
    ap.add_argument(
        "--window-kib", type=int, default=WINDOW_KIB, help="TCP windows held to this (0: the kernel's autotuning)"
    )
    ap.add_argument("--microbatches", type=int, default=4, help="microbatches a step (parallel.microbatches)")
    ap.add_argument("--variants", default="", help="comma list of the variants to run (default: all)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, help="write the raw results here")
    ap.add_argument("--table", type=Path, nargs="+", help="print the table of earlier results (joined) instead")
    ap.add_argument("--plot", type=Path)
    ns = ap.parse_args(argv)
    raw = joined([json.loads(p.read_text()) for p in ns.table]) if ns.table else run(ns)
    if ns.out and not ns.table:
        ns.out.write_text(json.dumps(raw))
    print("\n".join(table(raw)))
    if ns.plot:
        plot(raw, ns.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
