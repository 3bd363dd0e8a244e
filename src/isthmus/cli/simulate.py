"""`isthmus simulate`: run one layout through the discrete-event simulator.

    isthmus simulate --model.flavor gpt3-145.6b --model.n_layers 80 --topology selene-a100 --gpus 1536 \\
        --train.batch_size 2304 --train.seq_len 2048 --micro-batch 1 --parallel.activation_checkpoint full \\
        --parallel.tp 8 --parallel.pp 8 --parallel.pp_schedule interleaved_1f1b --parallel.pp_virtual_stages 2 \\
        --runtime megatron-2021 --trace t.json --png t.png

Takes ``isthmus plan``'s flags: the layout keys it names are fixed, and the search fills in the rest
(naming none: the planner's best). Prints the planner's figures as simulated (``--json``: the fields
of ``isthmus plan --json``), next to the cost model's step time.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from isthmus.cli import plan as plan_cli
from isthmus.errors import ConfigError
from isthmus.models.resolve import resolve_model_args
from isthmus.planner.placement import runnable
from isthmus.planner.search import search
from isthmus.sim import simulate, write_png, write_trace
from isthmus.sim.run import SimResult

DIFFER = 0.15
"""Past this relative difference between the two step times the output says which to trust."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``simulate`` sub-command: every ``plan`` flag, plus the layout and the outputs."""
    # The plan flags, from `isthmus plan` itself so the two commands never drift apart.
    scratch = argparse.ArgumentParser(add_help=False).add_subparsers()
    plan = plan_cli.add_parser(scratch)
    p = subparsers.add_parser(
        "simulate",
        parents=[plan],
        conflict_handler="resolve",
        allow_abbrev=False,
        help="simulate a layout event by event: step time, bubbles, a trace and a timeline (no GPU needed)",
        description="Simulate one or more training steps of a layout op by op (compute per device, transfers "
        "sharing links, the pipeline schedule per microbatch) and report the planner's figures; write a "
        "Chrome/Perfetto trace and a PNG timeline.",
    )
    p.add_argument(
        "--plan",
        action=plan_cli.refused("is given by the layout flags now, e.g. --parallel.tp 8 --parallel.pp 4 (see --help)"),
        help=argparse.SUPPRESS,
    )
    p.add_argument("--iterations", type=int, default=1, metavar="N", help="optimizer steps to simulate (default: 1)")
    p.add_argument("--trace", default=None, metavar="FILE.json", help="write a Chrome/Perfetto trace")
    p.add_argument("--png", default=None, metavar="FILE.png", help="write a timeline (needs the plot extra)")
    p.add_argument(
        "--json", action="store_true", help="print JSON (the fields of isthmus plan --json) instead of a table"
    )
    return p


def run(ns: argparse.Namespace, rest: list[str] | None = None) -> int:
    """Choose the layout, simulate it, print and write what was asked; 0 on success."""
    plan_cli.check_arguments(ns)
    if ns.iterations < 1:
        raise ConfigError("--iterations", ns.iterations, "must be at least 1")
    args = resolve_model_args(plan_cli.model_config(ns))
    topo = plan_cli.cli_topology(ns)
    space = plan_cli.search_space(ns)
    runtime = plan_cli.planned_runtime(ns, topo)
    dtype = ns.dtype or topo.datacenters[0].kind.default_dtype
    chosen = search(args, topo, space, runtime, top=ns.top, dtype=dtype).best
    record = bool(ns.trace or ns.png)
    result = simulate(chosen.work, topo, chosen.layout, runtime, iterations=ns.iterations, record=record)
    written = []
    if ns.trace:
        n = write_trace(result, ns.trace)
        written.append(f"trace: {ns.trace} ({n:,} events; open in ui.perfetto.dev)")
    if ns.png:
        write_png(result, ns.png)
        written.append(f"timeline: {ns.png}")
    if ns.json:
        out = result.as_json()
        out["what_if"] = runnable(topo, result.layout)  # as `isthmus plan --json` says it
        out["topology"] = topo.name
        out["nodes"] = {dc.name: dc.nodes for dc in topo.datacenters}
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
        return 0
    sys.stdout.write(format_result(result, topo.name) + "\n")
    sys.stdout.write(f"assumed software: {plan_cli.assumed_features(runtime, dtype)}\n")
    for line in written:
        sys.stdout.write(line + "\n")
    return 0


def format_result(r: SimResult, topo_name: str) -> str:
    """The simulated figures beside the cost model's, and the step by cause."""
    est = r.planner
    lay, work = r.layout, r.work
    sim: dict[str, Any] = r.as_json()["simulated"]  # type: ignore[assignment]
    rows = [
        ("step time", f"{r.step_time_s:.4g} s", f"{est.step_time_s:.4g} s"),
        ("tokens/s", f"{r.tokens_per_s:,.0f}", f"{est.tokens_per_s:,.0f}"),
        ("TFLOP/s per device", f"{r.tflops_per_device:.1f}", f"{est.tflops_per_device:.1f}"),
        ("MFU", f"{100 * r.mfu:.1f}%", f"{100 * est.mfu:.1f}%"),
        ("memory per device", f"{r.mem_per_device_gb:.2f} GB", f"{est.mem_per_device_gb:.2f} GB"),
        ("bubble", f"{100 * r.bubble_fraction:.1f}%", f"{100 * est.bubble_fraction:.1f}%"),
        ("WAN per step", f"{r.wan_bytes_per_step / 1e9:.3g} GB", f"{est.wan_bytes_per_step / 1e9:.3g} GB"),
        ("bottleneck", r.bottleneck, est.bottleneck),
    ]
    w0 = max(len(a) for a, _, _ in rows)
    w1 = max(len(b) for _, b, _ in rows + [("", "simulated", "")])
    lines = [
        f"isthmus simulate: {lay.label()} on {topo_name} ({lay.world:,} devices; {sim['devices_simulated']} simulated: "
        f"one data-parallel replica, one device per pipeline rank), {work.batch_size} x {work.seq_len} tokens, "
        f"{sim['iterations']} step(s), {sim['events']:,} events in {sim['wall_s']:.2f} s",
        "",
        f"{'':{w0}}  {'simulated':>{w1}}  cost model",
    ]
    lines += [f"{a:{w0}}  {b:>{w1}}  {c}" for a, b, c in rows]
    if abs(sim["vs_cost_model"]) > DIFFER:
        lines.append(
            f"the steps differ by {sim['vs_cost_model']:+.0%}: trust the simulated one, which runs the pipeline's "
            "actions in torch's order on shared links where the cost model has closed forms (docs/simulation.md)"
        )
    parts = "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r.breakdown.items() if v > 0)
    mem = r.memory
    held = (
        ("weights", mem.weights),
        ("grads", mem.grads),
        ("optimizer", mem.optimizer),
        ("activations", mem.activations),
        ("transient", mem.transient),
    )
    lines += [
        "",
        f"step by cause: {parts}",
        "memory of the fullest device: "
        + "  ".join(f"{k} {v / 1e9:.2f} GB" for k, v in held)
        + f"  (total {mem.total / 1e9:.2f} GB)",
    ]
    return "\n".join(lines)
