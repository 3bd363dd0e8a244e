"""How long `isthmus plan` takes for GPT-3 175B on the 12,288 H100s of geo-3dc-h100.

    python benchmarks/plan_speed.py            # GPT-3's training shape: 1536 x 2048 tokens
    python benchmarks/plan_speed.py --free     # global batch and sequence length left to the search

Prints the wall time of the search, how many layouts it considered, and the winner.
"""

from __future__ import annotations

import argparse
import sys
import time

from isthmus.models.flavors import get_flavor
from isthmus.planner.search import SearchSpace, search
from isthmus.planner.topology import load_topology
from isthmus.planner.workload import RUNTIMES


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--free", action="store_true", help="leave global batch and sequence length to the search")
    ap.add_argument("--repeat", type=int, default=3, help="runs; the best time is printed")
    ns = ap.parse_args(argv)
    args = get_flavor("gpt3-145.6b").with_overrides(n_layers=96)  # GPT-3 175B: 96 x 12288, 96 heads
    topo = load_topology("geo-3dc-h100")
    space = SearchSpace() if ns.free else SearchSpace(batch_size=1536, seq_len=2048)
    times = []
    for _ in range(ns.repeat):
        start = time.perf_counter()
        result = search(args, topo, space, RUNTIMES["isthmus"], top=10)
        times.append(time.perf_counter() - start)
    best = result.best
    print(
        f"GPT-3 175B on {topo.name} ({topo.n_devices:,} GPUs, {len(topo.datacenters)} datacenters), "
        f"{'shape searched' if ns.free else 'batch 1536 x 2048'}: {min(times):.2f} s "
        f"(best of {ns.repeat}), {result.considered:,} layouts considered, {result.pruned_memory:,} over memory"
    )
    print(
        f"winner: {best.layout.label()} at {best.work.batch_size} x {best.work.seq_len}, "
        f"{best.tokens_per_s:,.0f} tokens/s, MFU {100 * best.mfu:.1f}%"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
