"""WAN latency in the emulator: what the delay line gives and what it can carry.

    python benchmarks/wan_latency.py                 # all three parts (root; about a minute)

Every figure comes from real namespaces and packets (`isthmus.launch.emulate.emulated_network`
with 2 datacenters, probes of `isthmus.launch.wanprobe`):

1. RTT: the median of 9 ICMP echoes each way, at each --rtt-ms, 100 Mbit/s link.
2. Window limit: at 80 ms RTT and 100 Mbit/s, TCP flows from dc0 to dc1 whose socket buffers are
   clamped to 64 KiB (window / RTT ~ 6.5 Mbit/s each): 1 flow vs --flows (8, 16) flows together, and one
   flow with the kernel's autotuned buffers.
3. Ceiling of the delay line: the WAN shaped at 10 Gbit/s (so the forwarder, not tbf, is the
   bound), 2 ms RTT, 1 and 4 autotuned flows; Mbit/s and the packets/s the forwarder moved (both
   directions, ACKs included: the packets sent into the datacenters' TUNs during the measured
   window). The same without a delay line (RTT 0: the veth path) for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from isthmus.launch.emulate import EmulatedDatacenter, EmulatedNetwork, emulated_network
from isthmus.launch.wanprobe import ping_ms, tcp_flows_bps, tun_packets

WARM_S = 1.5
MEASURE_S = 3.0


def _net(wan_mbit: float, rtt_ms: float) -> EmulatedNetwork:
    return EmulatedNetwork([EmulatedDatacenter("dc0", 1), EmulatedDatacenter("dc1", 1)], wan_mbit, wan_rtt_ms=rtt_ms)


def rtt_rows(rtts_ms: list[float]) -> list[str]:
    rows = ["| set RTT ms | dc0 -> dc1 median ms | dc1 -> dc0 median ms | max of 18 ms |", "|---|---|---|---|"]
    for rtt in rtts_ms:
        with emulated_network(_net(100.0, rtt)) as em:
            there, back = ping_ms(em, 0, 1, count=9), ping_ms(em, 1, 0, count=9)
        rows.append(
            f"| {rtt:g} | {statistics.median(there):.2f} | {statistics.median(back):.2f} | {max(there + back):.2f} |"
        )
    return rows


def window_rows(flows: list[int]) -> list[str]:
    rows = ["| 80 ms RTT, 100 Mbit/s | Mbit/s |", "|---|---|"]
    cases = [("1 flow, 64 KiB buffers", 1, 64 * 1024)]
    cases += [(f"{n} flows, 64 KiB buffers each", n, 64 * 1024) for n in flows]
    cases += [("1 flow, autotuned buffers", 1, 0)]
    with emulated_network(_net(100.0, 80.0)) as em:
        for label, n, buf in cases:
            bps = tcp_flows_bps(em, 0, 1, flows=n, sock_buf_bytes=buf, warm_s=WARM_S, measure_s=MEASURE_S)
            rows.append(f"| {label} | {bps / 1e6:.1f} |")
    return rows


def _flows_and_packets(em_net: EmulatedNetwork, flows: int) -> tuple[float, float]:
    """Mbit/s of ``flows`` autotuned flows dc0 -> dc1, and the TUN packets/s in the measured window."""
    with emulated_network(em_net) as em:
        result: list[float] = []
        probe = threading.Thread(
            target=lambda: result.append(tcp_flows_bps(em, 0, 1, flows=flows, warm_s=WARM_S, measure_s=MEASURE_S))
        )
        probe.start()
        time.sleep(0.5 + WARM_S)  # the probe's processes start within ~0.5 s here; then its warm-up
        before, t0 = tun_packets(em), time.monotonic()
        time.sleep(MEASURE_S - 0.5)
        after, t1 = tun_packets(em), time.monotonic()
        probe.join()
    return result[0] / 1e6, (after - before) / (t1 - t0)


def ceiling_rows() -> list[str]:
    rows = ["| path (10 Gbit/s shaping) | flows | Mbit/s | forwarder packets/s |", "|---|---|---|---|"]
    for flows in (1, 4):
        mbit, pps = _flows_and_packets(_net(10_000.0, 2.0), flows)
        rows.append(f"| delay line, 2 ms RTT | {flows} | {mbit:.0f} | {pps:,.0f} |")
    for flows in (1, 4):
        mbit, _ = _flows_and_packets(_net(10_000.0, 0.0), flows)
        rows.append(f"| veth, no delay line (RTT 0) | {flows} | {mbit:.0f} | - |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rtt-ms", type=float, nargs="+", default=[10.0, 20.0, 80.0, 100.0])
    ap.add_argument("--flows", type=int, nargs="+", default=[8, 16])
    args = ap.parse_args()
    for rows in (rtt_rows(args.rtt_ms), window_rows(args.flows), ceiling_rows()):
        print("\n".join(rows), end="\n\n", flush=True)


if __name__ == "__main__":
    main()
