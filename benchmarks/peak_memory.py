"""The planner's memory per device against what local ranks really allocate, layout by layout.

    python benchmarks/peak_memory.py [--markdown] [--only 1,9] [--flavor small] [--dtype bf16] [--compile]
    python benchmarks/peak_memory.py --block      # what one block keeps per token, by precision
    python benchmarks/peak_memory.py --plot docs/img/peak_memory.svg   # and a bar per layout

For every layout, N gloo ranks build ``Trainer(cfg)`` exactly as ``isthmus train`` would (``small``,
16 x 128 tokens per step, fp32, the default data), run two steps (AdamW's state exists after the
first), then measure a third:

- **at rest**: every tensor alive between steps, as the garbage collector finds them, each storage
  counted once (parameters, optimizer state, DDP's buckets, whatever else the trainer keeps);
- **in the step**: torch.profiler's memory events (``profile_memory=True``: every CPU allocation
  and free, with its size) through the step; the largest running sum is the step's peak above rest.

A rank's peak is the two added. It is compared with ``planner.cost.rank_memory`` for the rank's
pipeline stage (its layers as the planner splits them), the figure behind ``mem_per_device_gb``;
ranks on the same stage are alike, and the larger of theirs counts. Why the profiler: torch keeps
no statistics for its CPU allocator (``torch.cpu`` has no ``max_memory_allocated``) and the
resident set also holds the interpreter, the libraries and freed memory the C allocator kept.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from isthmus.launch.warm import start_rank_server
from isthmus.layout.spec import LayoutSpec
from isthmus.models.flavors import get_flavor
from isthmus.planner.autoplan import local_runtime, local_topology
from isthmus.planner.cost import rank_memory, ranks_tp_on_host, stage_costs
from isthmus.planner.placement import place
from isthmus.planner.workload import Workload
from isthmus.train.short_run import max_steps_override

sys.path.insert(0, str(Path(__file__).parent))
from plan_vs_measured import BATCH, SEQ, to_layout, train_flags  # noqa: E402 - a sibling script
from zero_memory import rank_trainer, run_ranks  # noqa: E402

# (name, [parallel] values as benchmarks/plan_vs_measured.py takes them, activation checkpointing)
LAYOUTS: list[tuple[str, dict[str, object], str]] = [
    ("single", {}, "none"),
    ("single, full recomputation", {}, "full"),
    ("single, selective recomputation", {}, "selective"),
    ("single, grad_accum 2", {"grad_accum": 2}, "none"),
    ("dp_replicate 2", {"dp_replicate": 2}, "none"),
    ("dp_shard 2, zero 1", {"dp_shard": 2, "zero_stage": 1}, "none"),
    ("dp_shard 2, zero 2", {"dp_shard": 2, "zero_stage": 2}, "none"),
    ("dp_shard 2, zero 3", {"dp_shard": 2, "zero_stage": 3}, "none"),
    ("tp 2", {"tp": 2}, "none"),
    ("tp 2 + sp", {"tp": 2, "sequence_parallel": True}, "none"),
    ("cp 2", {"cp": 2}, "none"),
    ("pp 2 gpipe", {"pp": 2, "pp_schedule": "gpipe", "microbatches": 4}, "none"),
    ("pp 2 1f1b", {"pp": 2, "pp_schedule": "1f1b", "microbatches": 4}, "none"),
    ("pp 2 1f1b, full recomputation", {"pp": 2, "pp_schedule": "1f1b", "microbatches": 4}, "full"),
    ("dp 2 x tp 2", {"dp_replicate": 2, "tp": 2}, "none"),
]

MIB = 2**20


def live_tensor_bytes() -> int:
    """Bytes of every CPU tensor storage alive now, each once (views and shared storages too)."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        # A DTensor is a wrapper without storage of its own; its local tensor is found by itself.
        if isinstance(obj, torch.Tensor) and type(obj).__name__ != "DTensor" and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            try:
                storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # a compilation's FakeTensor (--compile): it holds no memory
                continue
    return sum(storages.values())


def step_peak_bytes(step: Any) -> int:
    """Run ``step()`` under torch.profiler's memory events; the highest allocated bytes above the start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    now = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        now += e.nbytes()  # negative for a free
        peak = max(peak, now)
    return peak


def _measure(flags: list[str], run_dir: str, cache_dir: str) -> dict[str, int]:
    """One rank: the trainer's bytes at rest after two steps and its peak through a third."""
    trainer = rank_trainer(3, run_dir, cache_dir, flags)
    for _ in range(2):
        trainer.train_step()
    rest = live_tensor_bytes()
    peak = step_peak_bytes(trainer.train_step)
    stage = trainer.mesh["pp"].get_local_rank() if trainer.mesh is not None and trainer.dims.pp_enabled else 0
    return {"rest": rest, "peak": rest + peak, "stage": stage}


@dataclass
class Row:
    name: str
    layout: LayoutSpec
    measured: list[dict[str, int]]
    """Per pipeline stage: the largest rest and peak of its ranks."""
    planned: list[float]
    """Per pipeline stage: the planner's peak in bytes."""


def planned(layout: LayoutSpec, flavor: str, dtype: str = "fp32", compiled: bool = False) -> list[float]:
    """The planner's peak memory of each pipeline stage."""
    work = Workload(get_flavor(flavor), BATCH, SEQ, dtype)
    runtime = local_runtime().with_compile(compiled)
    pl = place(local_topology(layout.world), layout)
    stages = stage_costs(work, layout, runtime, pl)
    return [
        rank_memory(work, layout, runtime, r, st.layers, tp_shared_file=ranks_tp_on_host(pl, runtime, r)).total
        for r, st in enumerate(stages)
    ]


def measure(
    name: str, values: dict[str, object], ac: str, flavor: str, root: Path, dtype: str = "fp32", compiled: bool = False
) -> Row:
    layout = replace(to_layout(values), activation_checkpoint=ac)
    flags = ["--model.flavor", flavor, *train_flags(layout), "--parallel.activation_checkpoint", ac]
    flags += ["--train.dtype", dtype, "--train.compile", str(compiled).lower()]
    run = root / name.replace(" ", "_").replace(",", "")
    ranks = run_ranks(_measure, layout.world, flags, str(run / "run"), str(root / "cache"))
    stages: list[dict[str, int]] = [{"rest": 0, "peak": 0} for _ in range(layout.pp)]
    for r in ranks:
        s = stages[r["stage"]]
        s["rest"], s["peak"] = max(s["rest"], r["rest"]), max(s["peak"], r["peak"])
    return Row(name, layout, stages, planned(layout, flavor, dtype, compiled))


def print_table(rows: list[Row], markdown: bool) -> None:
    head = ["#", "layout", "ranks", "stage", "at rest MiB", "peak MiB", "planned peak MiB", "error"]
    lines = [head]
    errors = []
    for i, row in enumerate(rows, 1):
        for stage, (got, peak_plan) in enumerate(zip(row.measured, row.planned)):
            error = peak_plan / got["peak"] - 1
            errors.append(abs(error))
            lines.append(
                [
                    str(i),
                    row.name,
                    str(row.layout.world),
                    str(stage) if row.layout.pp > 1 else "-",
                    f"{got['rest'] / MIB:.1f}",
                    f"{got['peak'] / MIB:.1f}",
                    f"{peak_plan / MIB:.1f}",
                    f"{error:+.1%}",
                ]
            )
    if markdown:
        print("| " + " | ".join(lines[0]) + " |")
        print("|" + "---|" * len(lines[0]))
        for line in lines[1:]:
            print("| " + " | ".join(line) + " |")
    else:
        widths = [max(len(line[c]) for line in lines) for c in range(len(head))]
        for line in lines:
            print(
                "  ".join(cell.rjust(w) if c >= 2 else cell.ljust(w) for c, (cell, w) in enumerate(zip(line, widths)))
            )
    errors.sort()
    median = (
        errors[len(errors) // 2] if len(errors) % 2 else sum(errors[len(errors) // 2 - 1 : len(errors) // 2 + 1]) / 2
    )
    print(f"\nplanned peak vs measured, {len(errors)} stages: median |error| {median:.1%}, max {max(errors):.1%}")


def plot(rows: list[Row], title: str, path: str) -> None:
    """Per layout and pipeline stage: the measured peak (at rest shaded in it) beside the planned one."""
    import plots

    plt = plots.pyplot()
    if plt is None:
        return
    bars = [
        (f"{i} {row.name}" + (f", stage {stage}" if row.layout.pp > 1 else ""), got, peak_plan)
        for i, row in enumerate(rows, 1)
        for stage, (got, peak_plan) in enumerate(zip(row.measured, row.planned))
    ]
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(bars) + 1.4))
    y = list(range(len(bars)))[::-1]
    ax.barh(
        [v + 0.2 for v in y],
        [b[1]["peak"] / MIB for b in bars],
        0.4,
        color=plots.COLORS["measured"],
        label="measured peak",
    )
    ax.barh(
        [v + 0.2 for v in y], [b[1]["rest"] / MIB for b in bars], 0.4, color=plots.COLORS["rest"], label="of it at rest"
    )
    ax.barh([v - 0.2 for v in y], [b[2] / MIB for b in bars], 0.4, color=plots.COLORS["planned"], label="planned peak")
    for v, (_, got, peak_plan) in zip(y, bars):
        ax.text(
            max(got["peak"], peak_plan) / MIB + 2, v, f"{peak_plan / got['peak'] - 1:+.1%}", va="center", fontsize=7
        )
    ax.set_yticks(y, [b[0] for b in bars])
    ax.set_xlabel("MiB per rank")
    ax.set_xlim(0, max(max(b[1]["peak"], b[2]) for b in bars) / MIB * 1.15)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    plots.save(fig, path)


def block_bytes(flavor: str, batch: int, precision: str) -> int:
    """Bytes autograd keeps for backward in one block of ``flavor`` at ``batch`` x SEQ tokens (each
    storage once, the block's parameters left out), in fp32, bf16 autocast over fp32 weights
    (isthmus's mixed precision where no FSDP) or bf16 throughout (FSDP2's mixed precision)."""
    from isthmus.models.llama import TransformerBlock, rope_cos_sin

    args = get_flavor(flavor)
    block = TransformerBlock(args)
    x = torch.randn(batch, SEQ, args.dim, requires_grad=True)
    if precision == "bf16":
        block = block.to(torch.bfloat16)
        x = x.detach().to(torch.bfloat16).requires_grad_()
    cos, sin = rope_cos_sin(torch.arange(SEQ), args.head_dim, args.rope_theta)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast-bf16"),
    ):
        block(x, cos, sin)
    return sum(kept.values())


def print_block(flavor: str) -> None:
    """Per precision, what one block keeps per token (the growth from batch 4 to 8) and per block
    (the rest: weight copies, rotary tables), against the planner's per-token accounting."""
    from isthmus.planner.compute import BlockShape
    from isthmus.planner.memory import layer_activation_bytes
    from isthmus.planner.workload import RUNTIMES

    args = get_flavor(flavor)
    print(f"{flavor}, one block at {SEQ} tokens per sequence, batch 4 and 8 (saved-tensor hooks)\n")
    print("| precision | kept per token, B | kept per block, KiB | planned per token, B (runtime) | kept / planned |")
    print("|---|---:|---:|---:|---:|")
    # (what the block computes in, the runtime counting it, its dtype, whether FSDP2 holds the weights)
    for precision, runtime, dtype, fsdp in (
        ("fp32", local_runtime(), "fp32", False),
        ("autocast-bf16", RUNTIMES["isthmus"], "bf16", False),
        ("bf16", RUNTIMES["isthmus"], "bf16", True),
        ("bf16", RUNTIMES["torchtitan"], "bf16", True),
    ):
        four, eight = block_bytes(flavor, 4, precision), block_bytes(flavor, 8, precision)
        per_token = (eight - four) / (4 * SEQ)
        fixed = four - 4 * SEQ * per_token
        planned = layer_activation_bytes(BlockShape(args, 1, 1, 1, 1, False, dtype), runtime, fsdp=fsdp)
        name = runtime.name + (", FSDP" if runtime.autocast and fsdp else "")
        cells = [precision, f"{per_token:,.0f}", f"{fixed / 1024:,.0f}", f"{planned:,.0f} ({name})"]
        print("| " + " | ".join(cells) + f" | {per_token / planned:.2f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="small")
    ap.add_argument("--only", default="", help="comma-separated row numbers (1-based) of the layouts to run")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--block", action="store_true", help="what one block keeps per token, by precision")
    ap.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="train.dtype of every layout (bf16: FSDP's mixed precision or autocast)",
    )
    ap.add_argument("--compile", action="store_true", help="every layout with --train.compile true")
    ap.add_argument("--plot", default="", help="also draw measured and planned peaks to this file (.svg, .png)")
    ns = ap.parse_args(argv)
    if ns.block:
        print_block(ns.flavor)
        return 0
    start_rank_server()  # every rank of every layout forks from it (isthmus.launch.warm)
    picked = [LAYOUTS[int(i) - 1] for i in ns.only.split(",")] if ns.only else LAYOUTS
    picked = picked[: 1 if max_steps_override() else len(picked)]  # ISTHMUS_MAX_STEPS: a smoke run, one layout
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(name, values, ac, ns.flavor, Path(tmp), ns.dtype, ns.compile) for name, values, ac in picked]
    compiled = ", compiled blocks (--train.compile true)" if ns.compile else ""
    title = f"{ns.flavor}, {BATCH} x {SEQ} tokens per step, {ns.dtype}{compiled}, AdamW"
    print(f"{title}; bytes CPU tensors hold\n")
    print_table(rows, ns.markdown)
    if ns.plot:
        plot(rows, f"Peak memory per rank, planned and measured\n{title}", ns.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
