"""Measure an emulated WAN as an application sees it: ICMP round trips and TCP throughput.

What shows that the emulation (:mod:`isthmus.launch.emulate`) behaves as a WAN: the rate tc gives
a transfer, the RTT a ping sees through the delay line (:mod:`isthmus.launch.delayline`), and TCP's
window limit (one flow gets window / RTT; several flows together get the link). Each probe runs its
ends inside the datacenters' namespaces (``ip netns exec``) as ``python -m isthmus.launch.wanprobe
ping|sink|source ...``, stdlib only (nothing here needs ``ping`` or ``iperf``), and each end stops
by its own deadline. The ends import nothing of the emulator: they start in a few tens of ms, as
the timing of the probes assumes.
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from isthmus.launch.emulate import Emulation

PROBE_PORT = 5201
ACCEPT_TIMEOUT_S = 20.0
"""How long the sink waits for the source's connections."""
_CHUNK = 1 << 16


def ping_ms(em: Emulation, src_dc: int, dst_dc: int, count: int = 5, interval_s: float = 0.2) -> list[float]:
    """The round-trip times (ms) of ``count`` ICMP echoes from datacenter ``src_dc`` to ``dst_dc``."""
    argv = _argv("ping", em.dcs[dst_dc].address, count, interval_s)
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
    n_bytes: int = 0,
    port: int = PROBE_PORT,
) -> float:
    """Bits/s that ``flows`` parallel TCP connections from ``src_dc`` to ``dst_dc`` carry together.

    Timed at the receiver: what arrives after the warm-up (``warm_s`` from the first byte: slow
    start left out), over the time from the warm-up's end to its last byte, for at most
    ``measure_s``. ``n_bytes`` (0: no bound) ends the transfer once that much has arrived in all, so
    a slower link gives the rate of what got through in ``measure_s``. ``sock_buf_bytes`` (0:
    autotuned) clamps each connection's SO_SNDBUF / SO_RCVBUF and so its window. ``src_dc ==
    dst_dc`` measures the namespace's own (loopback) path.
    """
    from isthmus.launch.emulate import stop_process_groups

    address = em.dcs[dst_dc].address
    common = [address, port, flows, sock_buf_bytes, n_bytes]
    sink = em.run_in(dst_dc, _argv("sink", *common, warm_s, measure_s), stdout=subprocess.PIPE, text=True)
    source = None
    try:
        assert sink.stdout is not None
        ready, _, _ = select.select([sink.stdout], [], [], ACCEPT_TIMEOUT_S)
        if not ready or sink.stdout.readline().strip() != "ready":
            raise RuntimeError(f"tcp probe: no listener in {em.dcs[dst_dc].namespace}")
        source = em.run_in(src_dc, _argv("source", *common, warm_s + measure_s + 2))
        out, _ = sink.communicate(timeout=ACCEPT_TIMEOUT_S + warm_s + measure_s + 10)
        source.wait(timeout=30)
    finally:
        stop_process_groups([p for p in (sink, source) if p is not None], grace_s=1.0)
    result = json.loads(out.strip().splitlines()[-1])
    if result["counted"] <= 0 or result["seconds"] <= 0:
        raise RuntimeError(f"tcp probe dc{src_dc} -> dc{dst_dc}: too little arrived to time ({result})")
    return float(result["counted"] * 8 / result["seconds"])


def tun_packets(em: Emulation) -> int:
    """Packets the datacenters have sent into their TUNs so far: every packet the delay line moved
    (or dropped). 0 without a delay line."""
    from isthmus.launch.delayline import TUN_IFNAME

    total = 0
    for dc in em.dcs:
        proc = subprocess.run(
            ["ip", "-n", dc.namespace, "-s", "-j", "link", "show", TUN_IFNAME], capture_output=True, text=True
        )
        if proc.returncode == 0:
            total += int(json.loads(proc.stdout)[0]["stats64"]["tx"]["packets"])
    return total


def _argv(end: str, *args: object) -> list[str]:
    return [sys.executable, "-m", "isthmus.launch.wanprobe", end, *map(str, args)]


# The probes' ends, run inside a namespace.


def _checksum(data: bytes) -> int:
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    s = (s >> 16) + (s & 0xFFFF)
    return ~(s + (s >> 16)) & 0xFFFF


def ping(address: str, count: int, interval_s: float) -> list[float]:
    """ICMP echo over a raw socket (root), answered by the peer's kernel: one RTT in ms per echo."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    sock.settimeout(5)
    ident, rtts = os.getpid() & 0xFFFF, []
    body = b"isthmus-ping" * 4
    for seq in range(count):
        head = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
        packet = struct.pack("!BBHHH", 8, 0, _checksum(head + body), ident, seq) + body
        t0 = time.monotonic()
        sock.sendto(packet, (address, 0))
        while True:
            data, _ = sock.recvfrom(2048)
            ihl = (data[0] & 15) * 4
            kind, (got_id, got_seq) = data[ihl], struct.unpack("!HH", data[ihl + 4 : ihl + 8])
            if kind == 0 and (got_id, got_seq) == (ident, seq):
                break
        rtts.append((time.monotonic() - t0) * 1e3)
        time.sleep(interval_s)
    return rtts


def listen(address: str, port: int, flows: int, sock_buf: int) -> socket.socket:
    """The sink's listener. A buffer size (0: the kernel's autotuning) bounds each flow's window:
    SO_RCVBUF is set before listen(), so the window scale the connections agree on fits it."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if sock_buf:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sock_buf)
    srv.bind((address, port))
    srv.listen(flows)
    srv.settimeout(ACCEPT_TIMEOUT_S)
    return srv


def receive(srv: socket.socket, flows: int, n_bytes: int, warm_s: float, measure_s: float) -> dict[str, float]:
    """Accept ``flows`` connections on ``srv`` and time what they carry together (as
    :func:`tcp_flows_bps` says): ``{"bytes": all that arrived, "counted": what arrived after the
    warm-up, "seconds": from the warm-up's end to the last counted byte}``.

    The chunk that ends the warm-up marks the start instant and is not counted. Reading stops
    ``measure_s`` after that (or after the warm-up, if nothing arrives), once ``n_bytes`` have
    arrived (0: no bound), or when every connection has closed.
    """
    conns: list[socket.socket] = []
    try:
        while len(conns) < flows:
            conns.append(srv.accept()[0])
    except TimeoutError:  # a source that never came: what arrived (maybe nothing) says so
        pass
    got = counted = 0
    first = start = None
    last = 0.0
    deadline = time.monotonic() + warm_s + measure_s
    while conns and (now := time.monotonic()) < deadline and not (n_bytes and got >= n_bytes):
        ready, _, _ = select.select(conns, [], [], min(0.2, deadline - now))
        for c in ready:
            data = c.recv(1 << 20)
            now = time.monotonic()
            if not data:
                conns.remove(c)
                c.close()
                continue
            got += len(data)
            if first is None:
                first = now
            if start is not None:
                counted, last = counted + len(data), now
            elif now >= first + warm_s:
                start, deadline = now, now + measure_s
    return {"bytes": got, "counted": counted, "seconds": last - start if start is not None and counted else 0.0}


def source(address: str, port: int, flows: int, sock_buf: int, n_bytes: int, seconds: float) -> None:
    """``flows`` connections that send together ``n_bytes`` (0: as much as they can) for at most
    ``seconds``; ``sock_buf`` (0: autotuned) clamps each one's SO_SNDBUF."""
    deadline = time.monotonic() + seconds
    share = -(-n_bytes // flows)  # each flow's part; 0: no bound
    chunk = bytes(_CHUNK)

    def flow() -> None:
        c = socket.socket()
        try:
            if sock_buf:
                c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sock_buf)
            c.settimeout(5)
            c.connect((address, port))
            sent = 0
            while (not share or sent < share) and (left := deadline - time.monotonic()) > 0:
                c.settimeout(max(0.01, left))
                k = min(_CHUNK, share - sent) if share else _CHUNK
                c.sendall(chunk[:k])
                sent += k
        except OSError:  # the sink stopped reading (its deadline) or never listened: it says what arrived
            pass
        finally:
            c.close()

    threads = [threading.Thread(target=flow) for _ in range(flows)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


__all__ = ["PROBE_PORT", "ping_ms", "tcp_flows_bps", "tun_packets"]


def main(argv: list[str]) -> int:
    end, *args = argv
    if end == "ping":
        address, n, interval = args
        sys.stdout.write(" ".join(f"{r:.3f}" for r in ping(address, int(n), float(interval))) + "\n")
    elif end == "sink":
        address, port, flows, buf, n_bytes, warm_s, measure_s = args
        srv = listen(address, int(port), int(flows), int(buf))
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        result = receive(srv, int(flows), int(n_bytes), float(warm_s), float(measure_s))
        sys.stdout.write(json.dumps(result) + "\n")
    elif end == "source":
        address, port, flows, buf, n_bytes, seconds = args
        source(address, int(port), int(flows), int(buf), int(n_bytes), float(seconds))
    else:
        raise SystemExit(f"isthmus.launch.wanprobe: no probe end named {end!r} (ping, sink, source)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
