"""Measure an emulated WAN as an application sees it: ICMP round trips and parallel TCP flows.

What shows that the delay line (:mod:`isthmus.launch.delayline`) behaves as a WAN: the RTT a ping
sees, and TCP's window limit (one flow gets window / RTT; several flows together get the link).
Each probe runs small stdlib scripts inside the datacenters' namespaces (``ip netns exec``) and
ends by its own deadline; nothing here needs ``ping`` or ``iperf``.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys

from isthmus.launch.delayline import TUN_IFNAME
from isthmus.launch.emulate import Emulation, stop_process_groups

# ICMP echo over a raw socket (root): the peer's kernel answers. Prints one RTT in ms per echo.
_PING = r"""
import os, socket, struct, sys, time
addr, count, interval = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
def checksum(b):
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    s = (s >> 16) + (s & 0xFFFF)
    return ~(s + (s >> 16)) & 0xFFFF
sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
sock.settimeout(5)
ident, rtts = os.getpid() & 0xFFFF, []
for seq in range(count):
    body = b"isthmus-ping" * 4
    head = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
    packet = struct.pack("!BBHHH", 8, 0, checksum(head + body), ident, seq) + body
    t0 = time.monotonic()
    sock.sendto(packet, (addr, 0))
    while True:
        data, _ = sock.recvfrom(2048)
        ihl = (data[0] & 15) * 4
        kind, (got_id, got_seq) = data[ihl], struct.unpack("!HH", data[ihl + 4:ihl + 8])
        if kind == 0 and (got_id, got_seq) == (ident, seq):
            break
    rtts.append((time.monotonic() - t0) * 1e3)
    time.sleep(interval)
print(" ".join(f"{r:.3f}" for r in rtts))
"""

# N TCP flows for a fixed time; the receiver counts what arrives after a warm-up (slow start left
# out). A buffer size (0: the kernel's autotuning) bounds each flow's window: SO_RCVBUF is set on
# the listener before listen(), so the window scale the connections agree on fits it.
_SINK = r"""
import json, select, socket, sys, time
addr, port, n, buf, warm_s, measure_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
if buf:
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buf)
srv.bind((addr, port)); srv.listen(n); srv.settimeout(20)
print("ready", flush=True)
conns = [srv.accept()[0] for _ in range(n)]
t0 = time.monotonic(); got = 0
while (now := time.monotonic()) < t0 + warm_s + measure_s:
    ready, _, _ = select.select(conns, [], [], 0.2)
    for c in ready:
        b = c.recv(1 << 20)
        if now >= t0 + warm_s:
            got += len(b)
print(json.dumps({"bits_per_s": got * 8 / measure_s}), flush=True)
"""

_SOURCE = r"""
import socket, sys, threading, time
addr, port, n, buf, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
deadline = time.monotonic() + seconds
def flow():
    c = socket.socket()
    if buf:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buf)
    c.settimeout(5)
    c.connect((addr, port))
    chunk = bytes(1 << 16)
    try:
        while time.monotonic() < deadline:
            c.sendall(chunk)
    except OSError:
        pass
    c.close()
threads = [threading.Thread(target=flow) for _ in range(n)]
for t in threads: t.start()
for t in threads: t.join()
"""

FLOWS_PORT = 5301


def ping_ms(em: Emulation, src_dc: int, dst_dc: int, count: int = 5, interval_s: float = 0.2) -> list[float]:
    """The round-trip times (ms) of ``count`` ICMP echoes from datacenter ``src_dc`` to ``dst_dc``."""
    argv = [sys.executable, "-c", _PING, em.dcs[dst_dc].address, str(count), str(interval_s)]
    proc = em.run_in(src_dc, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=count * (interval_s + 5) + 10)
    if proc.returncode != 0:
        raise RuntimeError(f"ping dc{src_dc} -> dc{dst_dc} failed: {err.strip().splitlines()[-1:] or proc.returncode}")
    return [float(x) for x in out.split()]


def tcp_flows_bps(
    em: Emulation,
    src_dc: int,
    dst_dc: int,
    flows: int = 1,
    sock_buf_bytes: int = 0,
    warm_s: float = 1.5,
    measure_s: float = 2.5,
    port: int = FLOWS_PORT,
) -> float:
    """Bits/s that ``flows`` parallel TCP connections from ``src_dc`` to ``dst_dc`` carry together,
    counted for ``measure_s`` after ``warm_s``; ``sock_buf_bytes`` (0: autotuned) clamps each one's
    SO_SNDBUF / SO_RCVBUF and so its window."""
    addr = em.dcs[dst_dc].address
    common = [addr, str(port), str(flows), str(sock_buf_bytes)]
    sink = em.run_in(
        dst_dc,
        [sys.executable, "-c", _SINK, *common, str(warm_s), str(measure_s)],
        stdout=subprocess.PIPE,
        text=True,
    )
    source = None
    try:
        assert sink.stdout is not None
        ready, _, _ = select.select([sink.stdout], [], [], 20.0)
        if not ready or sink.stdout.readline().strip() != "ready":
            raise RuntimeError(f"tcp flows probe: no listener in {em.dcs[dst_dc].namespace}")
        source = em.run_in(src_dc, [sys.executable, "-c", _SOURCE, *common, str(warm_s + measure_s + 2)])
        out, _ = sink.communicate(timeout=warm_s + measure_s + 30)
        source.wait(timeout=30)
    finally:
        stop_process_groups([p for p in (sink, source) if p is not None], grace_s=1.0)
    return float(json.loads(out.strip().splitlines()[-1])["bits_per_s"])


def tun_packets(em: Emulation) -> int:
    """Packets the datacenters have sent into their TUNs so far: every packet the delay line moved
    (or dropped). 0 without a delay line."""
    total = 0
    for dc in em.dcs:
        proc = subprocess.run(
            ["ip", "-n", dc.namespace, "-s", "-j", "link", "show", TUN_IFNAME], capture_output=True, text=True
        )
        if proc.returncode == 0:
            total += int(json.loads(proc.stdout)[0]["stats64"]["tx"]["packets"])
    return total


__all__ = ["FLOWS_PORT", "ping_ms", "tcp_flows_bps", "tun_packets"]
