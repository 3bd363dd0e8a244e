"""`isthmus profile`: measure this machine and write a topology file the planner and simulator read.

    isthmus profile --out local-profile.toml --seconds 20
    isthmus plan --model.flavor small --topology local-profile.toml --train.batch_size 16 --train.seq_len 128

What is measured, and how it becomes the planner's constants: `isthmus.profile.measure`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from isthmus.errors import ConfigError
from isthmus.launch.warm import start_rank_server, wait_for_rank_server
from isthmus.models.flavors import get_flavor
from isthmus.planner.topology import load_topology
from isthmus.train.short_run import max_steps_override


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "profile",
        allow_abbrev=False,
        help="measure this machine's compute and gloo bandwidth and write a topology file",
        description="Time fp32 matmuls (1 and N threads), elementwise bandwidth, per-op overhead and gloo "
        "all-reduce between two local ranks; fit the planner's constants and write a topology TOML.",
    )
    p.add_argument(
        "--out", default="local-profile.toml", metavar="FILE.toml", help="where to write (default: local-profile.toml)"
    )
    p.add_argument("--seconds", type=float, default=20.0, metavar="S", help="measurement budget, roughly (default: 20)")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        metavar="T",
        help=f"threads of a rank that has the machine alone (default: the cores, {os.cpu_count() or 1})",
    )
    p.add_argument("--name", default="local-profile", help="the topology's name (default: local-profile)")
    p.add_argument(
        "--model", default="small", metavar="FLAVOR", help="calibrate at this model's shapes (default: small)"
    )
    p.add_argument(
        "--batch", type=int, default=16, metavar="N", help="sequences per step to calibrate at (default: 16)"
    )
    p.add_argument("--seq-len", type=int, default=128, metavar="N", help="tokens per sequence (default: 128)")
    return p


def run(ns: argparse.Namespace, rest: list[str] | None = None) -> int:
    if not ns.seconds > 0:
        raise ConfigError("--seconds", ns.seconds, "must be positive")
    for key in ("batch", "seq_len"):
        if getattr(ns, key) < 1:
            raise ConfigError("--" + key.replace("_", "-"), getattr(ns, key), "must be at least 1")
    get_flavor(ns.model)  # an unknown flavor fails here, before any measuring
    cores = os.cpu_count() or 1
    threads = ns.threads or cores
    if threads < 1:
        raise ConfigError("--threads", ns.threads, "must be at least 1")
    out = Path(ns.out)
    if not out.parent.exists():
        raise ConfigError("--out", ns.out, "its directory does not exist")
    # ISTHMUS_MAX_STEPS=N (a smoke run, as the docs' commands run in the tests): at most N seconds.
    cap = max_steps_override()
    budget = ns.seconds if cap is None else min(ns.seconds, float(cap))
    load = os.getloadavg()[0]
    # The 2-rank measurements' processes fork from a server that imports torch beside this process.
    start_rank_server(("isthmus.profile.measure",))
    # Startup time: the measurements load torch, which `isthmus plan` and the rest of the CLI never need.
    from isthmus.profile.measure import measure, ms, times, topology_toml

    wait_for_rank_server()  # (its import would slow the first measurements down)

    # A smoke run repeats each measurement once: its figures mean nothing, its path is the same.
    prof = measure(budget, threads, ns.model, ns.batch, ns.seq_len, repeats=3 if cap is None else 1)
    # What MFU divides by: measured again here, where the machine is known to be in use for nothing else.
    from isthmus.profile.device import (  # torch: not for plan/simulate
        PEAK_CACHE_FILE,
        default_cache_dir,
        remeasure_cpu_peaks,
    )

    peaks = remeasure_cpu_peaks(sorted({1, threads}))
    text = topology_toml(prof, ns.name, cores)
    out.write_text(text)
    topo = load_topology(str(out))  # what was written must load
    dc = topo.datacenters[0]
    over = prof.get("overheads") or {}
    sys.stdout.write(
        f"isthmus profile: {cores} cores, {prof['seconds']:.1f} s, calibrated at {ns.model} {ns.batch} x {ns.seq_len}\n"
        f"  GEMM curve (1 thread): gemm_max_fraction {prof['fraction']:.3f}, gemm_half_dim {prof['half_dim']:g} "
        f"(rms error {100 * prof['fit_error']:.1f}% over {len(prof['gemms'])} shapes)\n"
        f"  one block forward + backward: {ms(prof['block_1t'])} on 1 thread ({ms(prof['block_quarter'])} at "
        "a quarter of the batch) -> "
        + (
            f"per-op {prof['launch_s'] * 1e6:.1f} us, memory {prof['memory_bandwidth'] / 1e9:.1f} GB/s effective"
            if prof["launch_s"] is not None
            else "per-op cost and memory bandwidth not fitted (the cpu kind's kept)"
        )
        + f"; {ms(prof['block_nt'])} on {threads} threads ({times(prof['speedup'])}); "
        f"{times(prof['shared'])} slower with both ranks computing\n"
        f"  gloo all-reduce, 2 ranks: {prof['gloo_bw'] / 1e9:.2f} GB/s, latency {prof['gloo_lat'] * 1e6:.0f} us\n"
        + (
            f"  shared-memory all-reduce (tensor parallelism's), 2 ranks: {prof['host_bw'] / 1e9:.2f} GB/s, "
            f"latency {prof['host_lat'] * 1e6:.0f} us\n"
            if prof.get("host")
            else ""
        )
        + f"  runtime work per block on 2 ranks: tp {ms(over.get('tp_block_s'))} per pass "
        f"(sp adds {ms(over.get('sp_block_s'))}), "
        f"FSDP2 {ms(over.get('shard_block_s'))} per collective"
        + (" (unresolved figures are not written: the kind's own stay)" if None in over.values() else "")
        + "\n"
        "  CPU peak for MFU: "
        + "; ".join(
            f"{t} thread(s) {peaks[t, 'fp32'] / 1e9:.1f} GFLOP/s fp32, {peaks[t, 'bf16'] / 1e9:.1f} bf16"
            for t in sorted({t for t, _ in peaks})
        )
        + f" (rewritten in {default_cache_dir() / PEAK_CACHE_FILE})\n"
        f"wrote {out} ({dc.devices} x {dc.kind.name}); use it with --topology {out}\n"
    )
    if max(load, os.getloadavg()[0]) > 0.5 * cores:
        sys.stdout.write(
            f"note: the load average was {max(load, os.getloadavg()[0]):.1f} on {cores} cores: other work "
            "shared the CPU, so these numbers understate an idle machine; profile again when it is quiet\n"
        )
    return 0
