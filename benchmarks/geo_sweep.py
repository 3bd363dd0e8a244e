"""What the planner sends over the WAN as the WAN gets slower (GPT-3 175B on geo-3dc-h100).

    python benchmarks/geo_sweep.py                 # full search space, batch 1536 x 2048
    python benchmarks/geo_sweep.py --markdown

For each WAN bandwidth (every link of the preset set to it, latencies kept) prints the winning
layout, what crosses the WAN, the bytes it sends there per step, and the tokens/s of the best layout
of each kind of crossing (the search keeps those exact while it prunes).
"""

from __future__ import annotations

import argparse
import sys

from isthmus.models.flavors import get_flavor
from isthmus.planner.search import SearchSpace, search
from isthmus.planner.topology import load_topology
from isthmus.planner.workload import RUNTIMES

BANDWIDTHS = (3000.0, 1000.0, 300.0, 100.0, 30.0, 10.0, 3.0, 1.0)


def crossing(axis: str, geo: str) -> str:
    return {"pp": "pipeline activations", "none": "nothing (one datacenter)"}.get(axis, f"gradients: {geo}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    ns = ap.parse_args(argv)
    args = get_flavor("gpt3-145.6b").with_overrides(n_layers=96)
    base = load_topology("geo-3dc-h100")
    if ns.markdown:
        print(
            "| WAN GB/s | winner | crosses the WAN | WAN GB/step | tokens/s | best pp across | best dp across | best in one DC |"
        )
        print("|---|---|---|---|---|---|---|---|")
    for bw in BANDWIDTHS:
        res = search(
            args,
            base.with_wan(bandwidth_gb_s=bw),
            SearchSpace(batch_size=1536, seq_len=2048),
            RUNTIMES["isthmus"],
            top=5,
        )
        best, alt = res.best, res.alternatives

        def rate(key: str) -> str:
            e = alt.get(key)
            if e is None:
                return "-"
            return f"{e.tokens_per_s / 1e6:.2f}M" + (f" ({e.layout.sync})" if e.layout.dc_axis == "dp" else "")

        cells = [
            f"{bw:g}",
            f"`{best.layout.label()}`",
            crossing(best.layout.dc_axis, best.layout.sync),
            f"{best.wan_bytes_per_step / 1e9:.3g}",
            f"{best.tokens_per_s / 1e6:.2f}M",
            rate("dc_axis=pp"),
            rate("dc_axis=dp"),
            rate("dc_axis=none"),
        ]
        print(("| " + " | ".join(cells) + " |") if ns.markdown else "  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
