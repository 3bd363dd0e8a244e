"""Colossal-AI's 2D, 2.5D and 3D tensor parallelism priced beside 1D tensor + sequence + context parallelism.

The planner's model of one transformer block (`isthmus.planner.tensor_nd`), per device: the bytes
each scheme's collectives move, forward and backward, for one microbatch; their time on the
topology's links; the compute with each GEMM at the shape the scheme gives it; the block's model
state and activations; and how many such blocks fit in device memory. Every scheme at each device
count in each of its shapes that splits the microbatch (2D, 2.5D and 3D split its sequences),
on an A100 cluster, an H100 cluster and the 3-datacenter preset with the group split over two
datacenters (east and central), where any group that spans both pays the WAN.

Nothing is run: the figures are the cost model's, from the shapes and the topology files.

    python benchmarks/tensor_nd.py [--model llama3-70b] [--seq-len 8192] [--micro-batch 16]
                                   [--devices 4,8,16,64,256] [--topology selene-a100,eos-h100,geo-3dc-h100]
                                   [--microbatches 8] [--plot docs/img/tensor_nd.svg]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from isthmus.errors import ConfigError
from isthmus.models.args import ModelArgs
from isthmus.models.flavors import FLAVORS, gpt3
from isthmus.planner.tensor_nd import SCHEMES, BlockPrice, grids, price
from isthmus.planner.topology import load_topology
from isthmus.planner.workload import RUNTIMES

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MODELS: dict[str, ModelArgs] = {**FLAVORS, "gpt3-175b": gpt3(96, 12288, 96)}
"""The flavors, and GPT-3 175B (Brown et al. 2020: 96 layers, 12,288 wide, 96 heads)."""
RUNTIME = "megatron-core"
"""bf16 weights, fp32 gradients, fp32 master weights and Adam moments; fused attention, no dropout."""
GEO_DCS = 2


def sweep(opts: argparse.Namespace) -> tuple[list[tuple[str, BlockPrice, float]], list[str]]:
    """(topology, price, device memory) of every scheme's shapes, and the shapes that could not split the microbatch."""
    args, runtime = MODELS[opts.model], RUNTIMES[RUNTIME]
    rows: list[tuple[str, BlockPrice, float]] = []
    skipped: list[str] = []
    for name in opts.topology:
        topo = load_topology(name)
        dc = topo.datacenters[0]
        geo = len(topo.datacenters) > 1
        dcs = GEO_DCS if geo else 1
        wan = topo.wan_link(topo.datacenters[0].name, topo.datacenters[1].name) if geo else None
        for p in opts.devices:
            for grid in grids(p, dc.devices_per_node):
                try:
                    r = price(grid, args, opts.micro_batch, opts.seq_len, dc, runtime, dcs=dcs, wan=wan,
                              microbatches_per_step=opts.microbatches)  # fmt: skip
                except ConfigError:
                    label = f"{grid.scheme} {grid.label}"
                    if not any(s.startswith(label) for s in skipped):
                        skipped.append(f"{label} (needs a multiple of {grid.batch_split} sequences)")
                    continue
                rows.append((name, r, dc.kind.memory_bytes))
    return rows, skipped


def print_table(rows: list[tuple[str, BlockPrice, float]], skipped: list[str], opts: argparse.Namespace) -> None:
    args = MODELS[opts.model]
    print(
        f"{opts.model} (dim {args.dim}, ffn {args.ffn_dim}, {args.n_heads} heads, {args.n_kv_heads} kv), one block, "
        f"{opts.micro_batch} x {opts.seq_len} tokens, bf16, per device; step = compute + comm; overlapped = the larger"
    )
    print()
    print(
        "| topology | devices | scheme | grid | comm GB | comm ms | compute ms | step ms | overlapped ms "
        "| state MB | act MB | buffers MB | blocks fit |"
    )
    print("|---|--:|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    best: dict[tuple[str, int], float] = {}
    for topo, r, _ in rows:
        key = (topo, r.grid.devices)
        best[key] = min(best.get(key, r.step_s), r.step_s)
    for topo, r, memory in rows:
        step = f"{r.step_s * 1e3:.1f}"
        if r.step_s == best[(topo, r.grid.devices)]:
            step = f"**{step}**"
        print(
            f"| {topo} | {r.grid.devices} | {r.grid.scheme} | {r.grid.label} | {r.comm_bytes / 1e9:.2f} "
            f"| {r.comm_s * 1e3:.1f} | {r.compute_s * 1e3:.1f} | {step} | {r.overlapped_s * 1e3:.1f} | {r.state_bytes / 1e6:.0f} "
            f"| {r.activation_bytes / 1e6:.0f} | {r.buffer_bytes / 1e6:.0f} | {r.layers_fit(memory)} |"
        )
    if skipped:
        print()
        print(f"not formed at {opts.micro_batch} sequences a microbatch: " + ", ".join(skipped))
    if any(len(load_topology(t).datacenters) > 1 for t in opts.topology):
        print(f"geo rows: the devices split evenly over {GEO_DCS} datacenters; a group spanning both pays the WAN")


def best_of(rows: list[tuple[str, BlockPrice, float]], topo: str, scheme: str) -> dict[int, BlockPrice]:
    """Per device count, the fastest shape of ``scheme`` on ``topo``."""
    out: dict[int, BlockPrice] = {}
    for t, r, _ in rows:
        if t == topo and r.grid.scheme == scheme:
            p = r.grid.devices
            if p not in out or r.step_s < out[p].step_s:
                out[p] = r
    return out


def plot(rows: list[tuple[str, BlockPrice, float]], opts: argparse.Namespace, path: str) -> None:
    """One panel per topology: step per block against devices, the fastest shape of each scheme; dotted: its comm alone."""
    import plots

    plt = plots.pyplot()
    if plt is None:
        return
    colors = dict(zip(SCHEMES, ("#1f77b4", "#17becf", "#ff7f0e", "#2ca02c", "#d62728"), strict=True))
    fig, axes = plt.subplots(1, len(opts.topology), figsize=(3.0 * len(opts.topology), 3.4), sharey=True)
    axes = axes if len(opts.topology) > 1 else [axes]
    for ax, topo in zip(axes, opts.topology, strict=True):
        for scheme in SCHEMES:
            pts = best_of(rows, topo, scheme)
            if not pts:
                continue
            ps = sorted(pts)
            ax.plot(ps, [pts[p].step_s * 1e3 for p in ps], "o-", color=colors[scheme], label=scheme, markersize=3)
            ax.plot(ps, [pts[p].comm_s * 1e3 for p in ps], ":", color=colors[scheme], linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(opts.devices, [str(p) for p in opts.devices])
        geo = len(load_topology(topo).datacenters) > 1
        ax.set_title(f"{topo}, over {GEO_DCS} datacenters" if geo else topo, fontsize=9)
        ax.set_xlabel("devices sharing the block")
        ax.grid(True, which="major", linewidth=0.3)
    axes[0].set_ylabel("ms per block (solid: step; dotted: comm)")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{opts.model}, {opts.micro_batch} x {opts.seq_len} tokens, bf16, one block fwd + bwd", fontsize=9)
    plots.save(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-70b", choices=sorted(MODELS))
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--micro-batch", type=int, default=16, help="sequences per microbatch")
    ap.add_argument("--devices", default="4,8,16,64,256", help="device counts sharing one block, comma-separated")
    ap.add_argument("--topology", default="selene-a100,eos-h100,geo-3dc-h100")
    ap.add_argument("--microbatches", type=int, default=8, help="microbatches a step shares its gradient sums over")
    ap.add_argument("--plot", default="", help="also draw step per block against devices to this file (.svg, .png)")
    opts = ap.parse_args(argv)
    opts.devices = [int(x) for x in opts.devices.split(",")]
    opts.topology = opts.topology.split(",")
    return opts


def main() -> None:
    opts = parse_args()
    rows, skipped = sweep(opts)
    print_table(rows, skipped, opts)
    if opts.plot:
        plot(rows, opts, opts.plot)


if __name__ == "__main__":
    main()
