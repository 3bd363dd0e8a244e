"""Predicted vs measured step time of `small` on 1 to 4 local ranks, and the planner's choice.

    python benchmarks/plan_vs_measured.py                      # profile, then every layout, one round
    python benchmarks/plan_vs_measured.py --topology local     # the shipped preset instead of a profile
    python benchmarks/plan_vs_measured.py --rounds 2 --markdown

First ``isthmus profile`` measures this machine (unless ``--topology`` names a file or preset).
Then every layout below runs as a real ``isthmus train`` (``--train.steps`` steps of 16 x 128
tokens, the default data) and its median step time, leaving out the first ``--skip`` steps, is
compared with the simulator's and the cost model's prediction for that many local ranks on the
profiled topology (``isthmus.planner.autoplan.local_topology``: threads per rank as the launcher sets them,
more ranks than cores time-sliced; ``autoplan.local_runtime``: gloo does not overlap compute). The
machine is shared: before each run the script waits (``--quiet``, ``--max-wait``) until other work
keeps fewer than 0.3 cores busy, and records what it saw. With ``--rounds R`` every layout runs R
times, round after round, and the least disturbed run counts (the smallest of the runs' medians:
other jobs only ever add time). Last, the planner's own choice for 1, 2 and 4 ranks (``choose_local_layout``) is run too
(when it is not in the list) and compared with the best measured layout.
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
from dataclasses import dataclass, field
from pathlib import Path

from isthmus.layout.spec import LayoutSpec
from isthmus.models.flavors import get_flavor
from isthmus.planner.autoplan import SIMPLEST_WITHIN, choose_layout, local_runtime, local_topology
from isthmus.planner.search import SearchSpace
from isthmus.planner.workload import Workload
from isthmus.sim import simulate

BATCH, SEQ = 16, 128

# (name, [parallel] values); nproc is the product of the degrees.
LAYOUTS: list[tuple[str, dict[str, object]]] = [
    ("single", {}),
    ("single, grad_accum 2", {"grad_accum": 2}),
    ("dp_replicate 2", {"dp_replicate": 2}),
    ("dp_shard 2, zero 1", {"dp_shard": 2, "zero_stage": 1}),
    ("dp_shard 2, zero 2", {"dp_shard": 2, "zero_stage": 2}),
    ("dp_shard 2, zero 3", {"dp_shard": 2, "zero_stage": 3}),
    ("tp 2", {"tp": 2}),
    ("tp 2 + sp", {"tp": 2, "sequence_parallel": True}),
    ("pp 2 gpipe", {"pp": 2, "pp_schedule": "gpipe", "microbatches": 4}),
    ("pp 2 1f1b", {"pp": 2, "pp_schedule": "1f1b", "microbatches": 4}),
    ("pp 2 interleaved v2", {"pp": 2, "pp_schedule": "interleaved_1f1b", "microbatches": 4, "pp_virtual_stages": 2}),
    ("dp 2 x tp 2", {"dp_replicate": 2, "tp": 2}),
    ("pp 2 x dp 2", {"pp": 2, "dp_replicate": 2, "pp_schedule": "1f1b", "microbatches": 4}),
    ("dp_replicate 4", {"dp_replicate": 4}),
]


@dataclass
class Row:
    name: str
    layout: LayoutSpec
    sim_s: float = 0.0
    cost_s: float = 0.0
    rounds: list[list[float]] = field(default_factory=list)
    """Step times of each run (the first steps left out)."""
    busy: list[float] = field(default_factory=list)
    """Cores other work kept busy just before each run."""

    @property
    def times(self) -> list[float]:
        return [t for r in self.rounds for t in r]

    @property
    def measured(self) -> float:
        """The least disturbed run's median step time: other jobs on a shared machine only add time."""
        return min(statistics.median(r) for r in self.rounds) if self.rounds else float("nan")

    @property
    def error(self) -> float:
        return self.sim_s / self.measured - 1


def to_layout(values: dict[str, object]) -> LayoutSpec:
    v = dict(values)
    accum = int(v.pop("grad_accum", 1))  # type: ignore[arg-type]
    dp = int(v.get("dp_replicate", 1)) * int(v.get("dp_shard", 1))  # type: ignore[arg-type]
    pp = int(v.get("pp", 1))  # type: ignore[arg-type]
    m = int(v.get("microbatches", 1)) if pp > 1 else 1  # type: ignore[arg-type]
    return LayoutSpec(
        tp=int(v.get("tp", 1)),
        cp=int(v.get("cp", 1)),  # type: ignore[arg-type]
        sequence_parallel=bool(v.get("sequence_parallel", False)),
        pp=pp,  # type: ignore[arg-type]
        pp_schedule=str(v.get("pp_schedule", "1f1b")),
        pp_virtual_stages=int(v.get("pp_virtual_stages", 1)),  # type: ignore[arg-type]
        dp_replicate=int(v.get("dp_replicate", 1)),
        dp_shard=int(v.get("dp_shard", 1)),  # type: ignore[arg-type]
        zero_stage=int(v.get("zero_stage", 3 if v.get("dp_shard", 1) != 1 else 1)),  # type: ignore[arg-type]
        micro_batch=BATCH // (dp * m * accum),
        microbatches=m,
        grad_accum=accum,
    )


def train_flags(lay: LayoutSpec) -> list[str]:
    flags = []
    for key, value in lay.parallel_config().items():
        if key in ("cp_impl", "activation_checkpoint"):
            continue
        flags += [f"--parallel.{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    flags += ["--train.grad_accum", str(lay.grad_accum)]
    return flags


def busy_cores(seconds: float = 1.0) -> float:
    """Cores the rest of the machine keeps busy, from /proc/stat over ``seconds``."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return (1 - (i1 - i0) / max(1, t1 - t0)) * (os.cpu_count() or 1)


def wait_quiet(limit: float, timeout: float) -> float:
    """Wait (up to ``timeout`` s) until other work keeps fewer than ``limit`` cores busy; returns the last reading."""
    start = time.perf_counter()
    busy = busy_cores()
    while busy > limit and time.perf_counter() - start < timeout:
        busy = busy_cores(2.0)
    return busy


def train_argv(flavor: str, steps: int, run_dir: Path, *flags: str) -> list[str]:
    """`python -m isthmus train` of ``flavor`` for ``steps`` steps into ``run_dir``, validation and
    the progress bar off, then ``flags``: how the benchmarks that time real runs start one."""
    return [
        sys.executable,
        "-m",
        "isthmus",
        "train",
        "--model.flavor",
        flavor,
        "--train.steps",
        str(steps),
        "--train.val_every",
        "0",
        "--metrics.progress",
        "false",
        "--train.run_dir",
        str(run_dir),
        *flags,
    ]


def measure(lay: LayoutSpec, steps: int, skip: int, root: Path, tag: str) -> list[float]:
    """Step times of one real `isthmus train` run of ``lay`` (the first ``skip`` left out)."""
    jsonl = root / f"{tag}.jsonl"
    cmd = train_argv(
        "small",
        steps,
        root / tag,
        "--train.batch_size",
        str(BATCH),
        "--train.seq_len",
        str(SEQ),
        "--train.val_batches",
        "1",
        "--train.warmup_steps",
        "2",
        "--metrics.log_every",
        "1000",
        "--metrics.jsonl",
        str(jsonl),
        *train_flags(lay),
    )
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    return [r["step_time_s"] for r in records if "step_time_s" in r][skip:]


def predict(rows: list[Row], topology: str) -> None:
    args = get_flavor("small")
    for row in rows:
        topo = local_topology(row.layout.world, topology)
        work = Workload(args, BATCH, SEQ, "fp32")
        res = simulate(work, topo, row.layout, local_runtime())
        row.sim_s, row.cost_s = res.step_time_s, res.planner.step_time_s


def planner_choice(nproc: int, topology: str) -> LayoutSpec:
    topo = local_topology(nproc, topology)
    space = SearchSpace({"activation_checkpoint": "none", "dc_axis": "none"}, batch_size=BATCH, seq_len=SEQ)
    return choose_layout(
        get_flavor("small"), topo, space, {"nproc": nproc}, local_runtime(), "fp32", top=50, band=SIMPLEST_WITHIN
    ).layout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default=None, help="topology file or preset (default: run isthmus profile first)")
    ap.add_argument("--profile-seconds", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="leading steps left out of the median")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--only", default=None, help="comma list of layout numbers (1-based) to run")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--save", default=None, metavar="FILE.json", help="write the rows as JSON")
    ap.add_argument(
        "--quiet",
        type=float,
        default=0.3,
        metavar="CORES",
        help="before each run, wait until other work keeps fewer cores busy (default: 0.3)",
    )
    ap.add_argument("--max-wait", type=float, default=120.0, metavar="S", help="longest wait for quiet (default: 120)")
    ap.add_argument(
        "--nice",
        type=int,
        default=0,
        metavar="N",
        help="run the profile and every training run at this niceness (negative needs root: other jobs "
        "on a shared machine then take less of the cores)",
    )
    ns = ap.parse_args(argv)
    if ns.nice:
        os.nice(ns.nice)  # children (the profile's gloo ranks, every `isthmus train`) inherit it
    root = Path(tempfile.mkdtemp(prefix="isthmus-pvm-"))
    load0 = os.getloadavg()[0]
    topology = ns.topology
    if topology is None:  # what `isthmus profile --out FILE --seconds S` does
        from isthmus.profile.measure import measure as profile
        from isthmus.profile.measure import topology_toml

        wait_quiet(ns.quiet, ns.max_wait)
        topology = str(root / "profile.toml")
        Path(topology).write_text(
            topology_toml(profile(ns.profile_seconds, os.cpu_count() or 1), "local-profile", os.cpu_count() or 1)
        )
    picked = [LAYOUTS[int(i) - 1] for i in ns.only.split(",")] if ns.only else LAYOUTS
    rows = [Row(name, to_layout(values)) for name, values in picked]
    choices = {n: planner_choice(n, topology) for n in (1, 2, 4)}
    for n, lay in choices.items():
        if all(r.layout != lay for r in rows):
            rows.append(Row(f"planner's choice, {n} rank{'s' if n > 1 else ''}", lay))
    predict(rows, topology)
    start = time.perf_counter()
    for rnd in range(ns.rounds):
        for i, row in enumerate(rows):
            row.busy.append(wait_quiet(ns.quiet, ns.max_wait))
            try:
                row.rounds.append(measure(row.layout, ns.steps, ns.skip, root, f"r{rnd}_{i}"))
            except RuntimeError as e:  # one broken layout does not lose the others' numbers
                print(f"round {rnd + 1}: {row.name} failed: {str(e).splitlines()[-2:]}", file=sys.stderr, flush=True)
                continue
            print(
                f"round {rnd + 1}/{ns.rounds} {row.name:28s} measured {row.measured:.3f} s  simulated {row.sim_s:.3f} s"
                f"  (other work: {row.busy[-1]:.2f} cores)",
                file=sys.stderr,
                flush=True,
            )
            if ns.save:
                save(rows, ns.save)
    wall = time.perf_counter() - start
    print_table(rows, choices, ns.markdown)
    print(
        f"\n{len(rows)} layouts x {ns.rounds} round(s) in {wall / 60:.1f} min; topology {topology}; "
        f"load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after; niceness {os.nice(0)}"
    )
    if ns.save:
        save(rows, ns.save)
    return 0


def save(rows: list[Row], path: str) -> None:
    Path(path).write_text(
        json.dumps(
            [
                {
                    "name": r.name,
                    "label": r.layout.label(),
                    "ranks": r.layout.world,
                    "simulated_s": r.sim_s,
                    "cost_model_s": r.cost_s,
                    "measured_s": r.measured,
                    "rounds": r.rounds,
                    "busy_cores": r.busy,
                }
                for r in rows
            ],
            indent=1,
        )
    )


def print_table(rows: list[Row], choices: dict[int, LayoutSpec], markdown: bool) -> None:
    head = ["#", "layout", "ranks", "measured s", "simulated s", "error", "cost model s", "error", "other work (cores)"]
    lines = []
    for i, r in enumerate(rows, 1):
        if not r.rounds:
            continue
        lines.append(
            [
                str(i),
                f"{r.name} ({r.layout.label()})",
                str(r.layout.world),
                f"{r.measured:.3f}",
                f"{r.sim_s:.3f}",
                f"{100 * r.error:+.1f}%",
                f"{r.cost_s:.3f}",
                f"{100 * (r.cost_s / r.measured - 1):+.1f}%",
                f"{max(r.busy):.2f}",
            ]
        )
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for cells in lines:
            print("| " + " | ".join(cells) + " |")
    else:
        widths = [max(len(c[k]) for c in [head] + lines) for k in range(len(head))]
        for cells in [head] + lines:
            print("  ".join(c.ljust(w) if k == 1 else c.rjust(w) for k, (c, w) in enumerate(zip(cells, widths))))
    rows = [r for r in rows if r.times]
    errs = [abs(r.error) for r in rows]
    cost = [abs(r.cost_s / r.measured - 1) for r in rows]
    print(
        f"\nmedian |error|: simulator {100 * statistics.median(errs):.1f}%, cost model {100 * statistics.median(cost):.1f}% "
        f"(max {100 * max(errs):.1f}%, {100 * max(cost):.1f}%)"
    )
    best = min(rows, key=lambda r: r.measured)
    for n, lay in choices.items():
        chosen = next((r for r in rows if r.layout == lay), None)
        if chosen is None:
            continue
        same = [r for r in rows if r.layout.world == n]
        best_n = min(same, key=lambda r: r.measured)
        print(
            f"planner's choice for {n} rank(s): {lay.label()}: measured {chosen.measured:.3f} s; best measured on {n} "
            f"rank(s) {best_n.name} {best_n.measured:.3f} s ({100 * (chosen.measured / best_n.measured - 1):+.1f}%)"
        )
    measured = [lay for lay in choices.values() if any(r.layout == lay for r in rows)]
    if not measured:
        return
    # The same rule as within one rank count: the fewest ranks within SIMPLEST_WITHIN of the best.
    predicted = {lay: next(r.sim_s for r in rows if r.layout == lay) for lay in measured}
    fastest = min(predicted.values())
    overall = min(
        (lay for lay in measured if predicted[lay] <= fastest / (1 - SIMPLEST_WITHIN)), key=lambda lay: lay.world
    )
    chosen = next(r for r in rows if r.layout == overall)
    print(
        f"planner's choice for this machine: {overall.label()} on {overall.world} rank(s), measured {chosen.measured:.3f} s; "
        f"best measured {best.name} {best.measured:.3f} s ({100 * (chosen.measured / best.measured - 1):+.1f}%)"
    )


if __name__ == "__main__":
    sys.exit(main())
