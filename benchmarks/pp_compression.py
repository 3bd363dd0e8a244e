"""Compressed pipeline boundaries across an emulated WAN: step time, busy fraction and loss of each method.

    python benchmarks/pp_compression.py timing --out timing.json     # 20 and 100 Mbit/s, 80 ms, and loopback
    python benchmarks/pp_compression.py loss --steps 150 --out loss.json
    python benchmarks/pp_compression.py table --timing timing.json --loss loss.json --plot docs/img/pp_compression.svg

timing: the layout of benchmarks/wan_pipeline.py (`small`, 2 datacenters x 2 CPU ranks, pp 2 with the
stage boundary on the WAN, 2 pipelines sharing the link, 1F1B with 4 microbatches, global batch
16 x 128, TCP windows held to 64 KiB) with today's best WAN settings, `--geo.wan_streams 4
--geo.wan_schedule time_shared`, each `geo.pp_compression` method (lowrank at rank 32) under `isthmus
emulate --wan-mbit R --wan-rtt-ms 80` (root) and the same command as local ranks on loopback (the
LAN: no emulated WAN). Per run: the median of rank 0's `step_time_s` over steps 3.. and the least
busy rank's median busy fraction (`--metrics.timeline`); the runs of one method go loopback, WAN,
WAN (the order of the methods alternates between rounds).

loss: the same model, batch and schedule as one pipeline (pp 2 over 2 ranks, `geo.dc_axis pp`, on
loopback: a loss does not depend on the network) for ``--steps`` steps at seeds 2 and 3, every
method, and with ``--variants one_rank`` exact on one rank without a pipeline (the same arithmetic in
another order: how far two runs that should train alike drift apart, the noise floor); the final figure is the mean training loss over the last 20 steps and the validation loss at
the end (evaluation sends exact activations), each against exact boundaries at the same seed.

table: the two tables, and with --plot the loss of each method (mean over seeds, smoothed) against
wall time, a step's wall time being the method's measured step time on the 100 Mbit/s WAN (and exact
on loopback for reference).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # wan_pipeline.py and plots.py, siblings

from isthmus.train.short_run import capped  # noqa: E402
from plots import pyplot, save  # noqa: E402
from wan_pipeline import BATCH, FLAVOR, MICROBATCHES, PIPELINE, SEQ  # noqa: E402

METHODS = ("none", "int8", "int4", "lowrank")
RANK, STREAMS, WINDOW_KIB, RTT_MS = 32, 4, 64, 80.0
BEST_WAN = ["--geo.wan_streams", str(STREAMS), "--geo.wan_schedule", "time_shared"]
ONE_RANK = "one_rank"
"""The loss runs' noise floor: exact, without a pipeline (1 rank, 4 accumulated microbatches)."""
TAIL = 20  # steps whose mean training loss is a run's final loss


def method_flags(method: str) -> list[str]:
    flags = ["--geo.pp_compression", method]
    return flags + (["--geo.pp_compression_rank", str(RANK)] if method == "lowrank" else [])


def train(
    out: Path,
    flags: list[str],
    nproc: int,
    steps: int,
    wan: float | None = None,
    batch: int = BATCH,
    window_kib: int = WINDOW_KIB,
) -> list[dict[str, Any]]:
    """One run's metric records with a loss: on loopback (``wan`` None) or under `isthmus emulate`
    with a ``wan`` Mbit/s, 80 ms link whose TCP windows are held to ``window_kib`` (0: the kernel's
    autotuning); ``batch`` sequences of SEQ tokens a step."""
    metrics = out / "metrics.jsonl"
    cmd = [sys.executable, "-m", "isthmus"]
    if wan is not None:
        cmd += ["emulate", "--topology", "emulated-2dc", "--wan-mbit", f"{wan:g}", "--wan-rtt-ms", f"{RTT_MS:g}"]
        cmd += ["--wan-window-kib", str(window_kib), "--timeout", "900", "--log-dir", str(out / "logs"), "--"]
    cmd += ["train", "--model.flavor", FLAVOR, "--parallel.nproc", str(nproc)]
    cmd += ["--parallel.microbatches", str(MICROBATCHES), "--geo.datacenters", "2"]
    cmd += ["--train.batch_size", str(batch), "--train.seq_len", str(SEQ), "--train.steps", str(steps)]
    cmd += ["--train.val_every", "0", "--train.run_dir", str(out / "run"), "--metrics.jsonl", str(metrics)]
    cmd += ["--metrics.progress", "false", *flags]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{wan} Mbit/s {flags} failed:\n{proc.stdout[-3000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def timing(ns: argparse.Namespace) -> dict[str, Any]:
    """Step time and least busy rank of every method on loopback and on each WAN rate."""
    rates = [float(r) for r in ns.mbit.split(",")]
    got: dict[str, dict[str, list[dict[str, Any]]]] = {m: {} for m in METHODS}
    steps = capped(ns.steps)
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(ns.first_round, ns.first_round + ns.rounds):
            for m in METHODS if rnd % 2 == 0 else METHODS[::-1]:
                for wan in [None, *rates]:
                    where = "lan" if wan is None else f"{wan:g}"
                    out = Path(tmp) / f"{m}-{where}-{rnd}"
                    flags = [*PIPELINE, *BEST_WAN, *method_flags(m), "--metrics.timeline", str(out / "tl.json")]
                    flags += ["--train.val_batches", "1"]  # the closing validation crosses the WAN too
                    records = [r for r in train(out, flags, 4, steps, wan) if "loss" in r]
                    timed = records[2:] or records[-1:]
                    busy = [statistics.median(r["busy"][k] for r in timed) for k in range(len(timed[0]["busy"]))]
                    row = {
                        "step_s": statistics.median(r["step_time_s"] for r in timed),
                        "least_busy": min(busy),
                        "wan_bytes": timed[-1].get("wan_bytes", 0),
                        "load": os.getloadavg()[0],
                    }
                    got[m].setdefault(where, []).append(row)
                    print(f"  {m} {where} round {rnd}: {row}", file=sys.stderr, flush=True)
    return {"rates": rates, "steps": steps, "rounds": ns.rounds, "runs": got}


def loss(ns: argparse.Namespace) -> dict[str, Any]:
    """Each method's losses at seeds ``ns.seeds``, one pipeline on loopback."""
    steps = capped(ns.steps)
    got: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in ns.seeds.split(","):
            for m in ns.variants.split(","):
                out = Path(tmp) / f"{m}-{seed}"
                if m == ONE_RANK:  # the same model, batch and data on one rank: rounding differs, nothing else
                    flags = [
                        "--geo.datacenters",
                        "1",
                        "--parallel.microbatches",
                        "1",
                        "--train.grad_accum",
                        str(ns.microbatches),
                    ]
                    nproc = 1
                else:
                    flags, nproc = ["--parallel.pp", "2", "--geo.dc_axis", "pp", *method_flags(m)], 2
                    flags += ["--parallel.microbatches", str(ns.microbatches)]  # after train()'s own: it wins
                records = train(out, [*flags, "--train.seed", seed], nproc, steps, None, ns.batch)
                losses = [r["loss"] for r in records if "loss" in r]
                val = [r["val_loss"] for r in records if "val_loss" in r]
                got[f"{m}/{seed}"] = {"losses": losses, "val_loss": val[-1] if val else None}
                print(f"  {m} seed {seed}: last {losses[-1]:.4f}, val {val[-1] if val else '-'}", file=sys.stderr)
    return {
        "steps": steps,
        "batch": ns.batch,
        "microbatches": ns.microbatches,
        "seeds": ns.seeds.split(","),
        "runs": got,
    }


def joined(raws: list[dict[str, Any]]) -> dict[str, Any]:
    """Timing results of separate invocations as one: every rate, every run of each method and place."""
    out: dict[str, Any] = {"rates": sorted({r for raw in raws for r in raw["rates"]}), "runs": {}}
    for raw in raws:
        for m, places in raw["runs"].items():
            for where, rows in places.items():
                out["runs"].setdefault(m, {}).setdefault(where, []).extend(rows)
    return out


def timing_table(raw: dict[str, Any]) -> list[str]:
    wheres = ["lan", *(f"{r:g}" for r in raw["rates"])]
    head = " | ".join(f"{'loopback' if w == 'lan' else w + ' Mbit/s'} s (least busy)" for w in wheres)
    lines = [f"| method | {head} | WAN MiB / step | 100 Mbit/s / exact loopback |", "|" + "---|" * (len(wheres) + 3)]
    lan = statistics.median(r["step_s"] for r in raw["runs"]["none"]["lan"])
    for m in METHODS:
        runs = raw["runs"][m]
        med = {w: statistics.median(r["step_s"] for r in runs[w]) for w in wheres}
        busy = {w: statistics.median(r["least_busy"] for r in runs[w]) for w in wheres}
        cells = " | ".join(f"{med[w]:.3f} ({busy[w]:.0%})" for w in wheres)
        mib = runs[wheres[-1]][0]["wan_bytes"] / 2**20
        ratio = f"{med['100'] / lan:.2f}" if "100" in med else "-"
        lines.append(f"| {m} | {cells} | {mib:.2f} | {ratio} |")
    loads = [r["load"] for m in METHODS for w in wheres for r in raw["runs"][m][w]]
    lines.append(f"\nload average (1 min) during the runs: {min(loads):.1f}-{max(loads):.1f}")
    return lines


def final(losses: list[float]) -> float:
    return statistics.mean(losses[-TAIL:])


def loss_table(raw: dict[str, Any]) -> list[str]:
    lines = ["| method | " + " | ".join(f"seed {s}: train (val), vs exact" for s in raw["seeds"]) + " |"]
    lines.append("|" + "---|" * (len(raw["seeds"]) + 1))
    for m in [*METHODS, ONE_RANK]:
        if f"{m}/{raw['seeds'][0]}" not in raw["runs"]:
            continue
        cells = []
        for s in raw["seeds"]:
            mine, ref = raw["runs"][f"{m}/{s}"], raw["runs"].get(f"none/{s}")
            if ref is None:  # no exact run among these results
                cells.append(f"{final(mine['losses']):.4f} ({mine['val_loss']:.4f}), -")
                continue
            d_train = final(mine["losses"]) / final(ref["losses"]) - 1
            d_val = mine["val_loss"] / ref["val_loss"] - 1
            cells.append(
                f"{final(mine['losses']):.4f} ({mine['val_loss']:.4f}), {100 * d_train:+.2f}% ({100 * d_val:+.2f}%)"
            )
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def plot(timing_raw: dict[str, Any], loss_raw: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.4, 3.8))

    def smooth(xs: list[float], k: int = 10) -> list[float]:
        return [statistics.mean(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]

    def curve(m: str) -> list[float]:
        per_seed = [loss_raw["runs"][f"{m}/{s}"]["losses"] for s in loss_raw["seeds"]]
        return smooth([statistics.mean(v) for v in zip(*per_seed, strict=True)])

    lan = statistics.median(r["step_s"] for r in timing_raw["runs"]["none"]["lan"])
    lines = [(m, "100") for m in METHODS] + [("none", "lan")]
    for m, where in lines:
        step = statistics.median(r["step_s"] for r in timing_raw["runs"][m][where]) if where != "lan" else lan
        ys = curve(m)
        label = f"{m}, 100 Mbit/s 80 ms" if where != "lan" else "none, loopback"
        ax.plot([step * (i + 1) for i in range(len(ys))], ys, label=label, ls="--" if where == "lan" else "-")
    ax.set_xscale("log")
    ax.set_xlabel("wall time, s (steps x measured step time)")
    ax.set_ylabel(f"training loss (mean of seeds, {10}-step mean)")
    ax.set_title("pp 2 across the WAN: compressed boundaries, small")
    ax.legend(fontsize=8)
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("timing", help="step time and busy fraction, emulated WAN and loopback (root)")
    t.add_argument("--mbit", default="20,100", help="WAN rates, Mbit/s (comma list)")
    t.add_argument("--steps", type=int, default=6)
    t.add_argument("--rounds", type=int, default=1)
    t.add_argument("--first-round", type=int, default=0, help="number of the first round (sets the order)")
    t.add_argument("--out", type=Path, required=True)
    lo = sub.add_parser("loss", help="losses of every method at two seeds (loopback)")
    lo.add_argument("--steps", type=int, default=150)
    lo.add_argument("--seeds", default="2,3")
    lo.add_argument("--variants", default=",".join(METHODS), help=f"of {', '.join(METHODS)}, {ONE_RANK}")
    lo.add_argument("--batch", type=int, default=BATCH, help=f"sequences of {SEQ} tokens a step")
    lo.add_argument("--microbatches", type=int, default=MICROBATCHES)
    lo.add_argument("--out", type=Path, required=True)
    tb = sub.add_parser("table", help="the tables (and plot) of earlier results")
    tb.add_argument("--timing", type=Path, nargs="+", required=True, help="timing results (their runs joined)")
    tb.add_argument("--loss", type=Path, nargs="+", required=True, help="loss results (their runs joined)")
    tb.add_argument("--plot", type=Path)
    ns = ap.parse_args(argv)
    if ns.what in ("timing", "loss"):
        raw = timing(ns) if ns.what == "timing" else loss(ns)
        ns.out.write_text(json.dumps(raw))
        print("\n".join(timing_table(raw) if ns.what == "timing" else loss_table(raw)))
        return 0
    timing_raw = joined([json.loads(p.read_text()) for p in ns.timing])
    losses = [json.loads(p.read_text()) for p in ns.loss]
    loss_raw = {**losses[0], "runs": {k: v for raw in losses for k, v in raw["runs"].items()}}
    print("\n".join(timing_table(timing_raw)))
    print()
    print("\n".join(loss_table(loss_raw)))
    if ns.plot:
        plot(timing_raw, loss_raw, ns.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
