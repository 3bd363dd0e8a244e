"""Tensor parallelism against one process on the whole machine: does splitting the model pay?

    python benchmarks/tp_vs_one.py                     # `small`, 4 rounds x 30 steps
    python benchmarks/tp_vs_one.py --flavor small --rounds 6 --steps 40 --also "--parallel.sequence_parallel true"
    python benchmarks/tp_vs_one.py --common "--train.compile true"   # both layouts compiled

Each round runs, as a user types them, `isthmus train --parallel.nproc 1` (one process, one
thread per core) and `isthmus train --parallel.nproc 2 --parallel.tp 2` (one thread per rank), in
turn (odd rounds start with tp), same seed and data, validation off. A run's rate is its tokens
per step over the median `step_time_s` of steps 3.. from its metrics JSONL (start-up, the first
step and its allocator warm-up left out). Printed: each layout's tokens/s per round, the per-round
ratios tp / one process and their median. ``--also FLAGS`` adds a third layout: tp 2 with FLAGS;
``--common FLAGS`` adds FLAGS to every layout.
Each run starts once other work keeps fewer than ``--quiet-cores`` cores busy (or after 5 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import tempfile
from pathlib import Path

from isthmus.train.short_run import capped, max_steps_override
from plan_vs_measured import train_argv, wait_quiet  # the script's folder is on sys.path


def run(flags: list[str], opts: argparse.Namespace, root: Path, tag: str) -> float:
    """Tokens/s of one `isthmus train` run: tokens per step over its median step time (steps 3..)."""
    run_dir = root / tag
    cmd = train_argv(opts.flavor, opts.steps, run_dir, "--data.cache_dir", str(root / "cache"), *flags)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step_time_s" in r]
    timed = [r["step_time_s"] for r in steps[2:]] or [r["step_time_s"] for r in steps]
    tokens = steps[-1]["tokens_per_s"] * steps[-1]["step_time_s"]  # tokens per step, as the trainer counts them
    return tokens / statistics.median(timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="small")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30, help="steps per run (the median of steps 3.. is its rate)")
    ap.add_argument(
        "--quiet-cores", type=float, default=0.3, help="wait (up to 5 min) until other work keeps fewer cores busy"
    )
    ap.add_argument("--also", default="", help="flags of a third layout, tp 2 with these added")
    ap.add_argument("--common", default="", help="flags added to every layout (e.g. '--train.compile true')")
    opts = ap.parse_args()
    # A short run (the docs test) checks that the benchmark works: one round is enough for that.
    opts.rounds = 1 if max_steps_override() is not None else opts.rounds
    opts.steps = max(capped(opts.steps), 2)
    layouts = {"one process": ["--parallel.nproc", "1"], "tp 2": ["--parallel.nproc", "2", "--parallel.tp", "2"]}
    if opts.also:
        layouts[f"tp 2 {opts.also}"] = layouts["tp 2"] + shlex.split(opts.also)
    layouts = {name: flags + shlex.split(opts.common) for name, flags in layouts.items()}
    rates: dict[str, list[float]] = {name: [] for name in layouts}
    with tempfile.TemporaryDirectory(prefix="isthmus-tp-") as tmp:
        root = Path(tmp)
        for r in range(opts.rounds):
            names = list(layouts) if r % 2 == 0 else list(reversed(layouts))
            for name in names:
                # A process on two threads loses far more to a third busy core than two one-thread
                # ranks do (its threads wait on each other): start each run on a quiet machine.
                wait_quiet(opts.quiet_cores, timeout=0 if max_steps_override() is not None else 300)
                rates[name].append(run(layouts[name], opts, root, f"r{r}-{name.replace(' ', '_')}"))
            print(
                f"round {r + 1}: " + ", ".join(f"{name} {rates[name][-1]:,.0f} tok/s" for name in layouts),
                flush=True,
            )
    base = rates["one process"]
    common = f", every layout with {opts.common}" if opts.common else ""
    print(f"\n{opts.flavor}, {os.cpu_count()} cores, {opts.rounds} rounds x {opts.steps} steps{common}")
    print("| layout | tokens/s (median) | per-round ratio vs one process | median ratio |")
    print("|---|---:|---|---:|")
    for name, values in rates.items():
        ratios = [v / b for v, b in zip(values, base, strict=True)]
        print(
            f"| {name} | {statistics.median(values):,.0f} | {', '.join(f'{x:.2f}' for x in ratios)} "
            f"| {statistics.median(ratios):.2f} |"
        )


if __name__ == "__main__":
    main()
