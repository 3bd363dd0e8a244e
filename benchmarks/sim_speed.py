"""The simulator's benchmarks: how long one step on 1,024 GPUs takes to simulate, and its checks.

    python benchmarks/sim_speed.py --markdown              # speed (docs/benchmarks.md)
    python benchmarks/sim_speed.py --agreement --markdown  # simulator vs cost model, tests/sim/test_sim.py's layouts
    python benchmarks/sim_speed.py --megatron --markdown   # Megatron-LM 2021 Table 1 through the simulator

Each case is one optimizer step of GPT-3 175B (gpt3-145.6b with 96 layers) or a Megatron Table 1
row on selene-a100, simulated once without recording (what `isthmus simulate` prints) and once
recording every interval (what --trace / --png need). The planner's own choice for 1,024 GPUs is
the first case; the search time is not counted.
"""

from __future__ import annotations

import argparse
import sys
import time

from isthmus.layout.spec import LayoutSpec
from isthmus.models.flavors import gpt3
from isthmus.planner.reference import MEGATRON_2021_TABLE1, SEQ_LEN, megatron_layout
from isthmus.planner.search import SearchSpace, search
from isthmus.planner.topology import load_topology
from isthmus.planner.workload import RUNTIMES, Workload
from isthmus.sim import simulate

GPT3_175B = gpt3(96, 12288, 96)


def cases() -> list[tuple[str, Workload, LayoutSpec, int, str]]:
    topo = load_topology("selene-a100").subset(1024)
    work = Workload(GPT3_175B, 1536, 2048, "bf16")
    best = search(GPT3_175B, topo, SearchSpace(batch_size=1536, seq_len=2048), RUNTIMES["isthmus"], top=1).best
    out = [("GPT-3 175B, planner's choice", best.work, best.layout, 1024, "isthmus")]
    out.append(
        (
            "GPT-3 175B, tp8 pp16 interleaved v2",
            work,
            LayoutSpec(
                tp=8,
                sequence_parallel=True,
                pp=16,
                pp_schedule="interleaved_1f1b",
                pp_virtual_stages=2,
                dp_replicate=8,
                micro_batch=1,
                microbatches=192,
                activation_checkpoint="full",
            ),
            1024,
            "isthmus",
        )
    )
    for row in (MEGATRON_2021_TABLE1[5], MEGATRON_2021_TABLE1[9]):
        w = Workload(gpt3(row.heads, row.hidden, row.layers), row.global_batch, SEQ_LEN, "fp16")
        out.append((f"Megatron {row.params_b}B row", w, megatron_layout(row), row.gpus, "megatron-2021"))
    return out


def print_rows(head: list[str], rows: list[list[str]], markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
        return
    widths = [max(len(r[k]) for r in [head] + rows) for k in range(len(head))]
    for r in [head] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def agreement(markdown: bool) -> None:
    """The layouts of tests/sim/test_sim.py::test_simulator_agrees_with_the_cost_model."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tests" / "sim"))
    from test_sim import AGREE  # the test's own list, so the table and the test never differ

    from isthmus.models.flavors import get_flavor

    rows, worst = [], 0.0
    for flavor, topology, lay, batch, seq in AGREE:
        topo = load_topology(topology).subset(lay.world)
        work = Workload(get_flavor(flavor), batch, seq, topo.datacenters[0].kind.default_dtype)
        res = simulate(work, topo, lay, RUNTIMES["isthmus"])
        err = res.step_time_s / res.planner.step_time_s - 1
        worst = max(worst, abs(err))
        rows.append(
            [
                flavor,
                topology,
                lay.label(),
                f"{res.planner.step_time_s:.4g}",
                f"{res.step_time_s:.4g}",
                f"{100 * err:+.2f}%",
                f"{100 * res.planner.bubble_fraction:.1f}%",
                f"{100 * res.bubble_fraction:.1f}%",
            ]
        )
    print_rows(
        [
            "model",
            "topology",
            "layout",
            "cost model s",
            "simulated s",
            "difference",
            "bubble (cost model)",
            "bubble (simulated)",
        ],
        rows,
        markdown,
    )
    print(f"\nmax |difference| {100 * worst:.2f}%")


def megatron(markdown: bool) -> None:
    rows, worst = [], 0.0
    for row in MEGATRON_2021_TABLE1:
        lay = megatron_layout(row)
        w = Workload(gpt3(row.heads, row.hidden, row.layers), row.global_batch, SEQ_LEN, "fp16")
        res = simulate(w, load_topology("selene-a100").subset(row.gpus), lay, RUNTIMES["megatron-2021"])
        err = res.tflops_per_device / row.tflops_per_gpu - 1
        worst = max(worst, abs(err))
        rows.append(
            [
                f"{row.params_b}B",
                str(row.tp),
                str(row.pp),
                f"{row.gpus:,}",
                str(res.devices_simulated),
                str(row.tflops_per_gpu),
                f"{res.planner.tflops_per_device:.1f}",
                f"{res.tflops_per_device:.1f}",
                f"{100 * err:+.1f}%",
                f"{100 * res.bubble_fraction:.1f}%",
                f"{res.wall_s:.2f}",
            ]
        )
    print_rows(
        [
            "model",
            "tp",
            "pp",
            "GPUs",
            "simulated devices",
            "published TFLOP/s",
            "cost model",
            "simulated",
            "error",
            "bubble",
            "sim wall s",
        ],
        rows,
        markdown,
    )
    print(f"\nmax |error| {100 * worst:.1f}%")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--agreement", action="store_true", help="simulator vs cost model instead of speed")
    ap.add_argument("--megatron", action="store_true", help="Megatron-LM 2021 Table 1 through the simulator instead")
    ns = ap.parse_args(argv)
    if ns.agreement:
        agreement(ns.markdown)
        return 0
    if ns.megatron:
        megatron(ns.markdown)
        return 0
    head = ["case", "layout", "GPUs", "simulated devices", "ops", "events", "step s", "sim wall s", "with trace s"]
    rows = []
    for name, work, lay, gpus, runtime in cases():
        topo = load_topology("selene-a100").subset(gpus)
        t = time.perf_counter()
        res = simulate(work, topo, lay, RUNTIMES[runtime])
        plain = time.perf_counter() - t
        t = time.perf_counter()
        rec = simulate(work, topo, lay, RUNTIMES[runtime], record=True)
        traced = time.perf_counter() - t
        ops = sum(e.lane == "compute" for e in rec.trace_events)
        rows.append(
            [
                name,
                lay.label(),
                f"{gpus:,}",
                str(res.devices_simulated),
                f"{ops:,}",
                f"{res.events:,}",
                f"{res.step_time_s:.2f}",
                f"{plain:.2f}",
                f"{traced:.2f}",
            ]
        )
        print(f"{name}: {plain:.2f} s ({traced:.2f} s with the trace)", file=sys.stderr, flush=True)
    print_rows(head, rows, ns.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
