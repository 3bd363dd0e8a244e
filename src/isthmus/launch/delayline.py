"""WAN latency without netem: a user-space delay line between the emulated datacenters' TUN devices.

This kernel has no ``netem`` (nor ``fq``/``etf``), so no qdisc can hold a packet for a fixed time.
Instead, when the WAN has a round-trip time, each datacenter's namespace gets a TUN device
(``wan1``) that routes the other datacenters' addresses; one forwarder process, a child of the
emulation running in its ``-wan`` namespace, reads the IPv4 packets every datacenter sends into
its TUN, and writes each into the destination datacenter's TUN once the pair's one-way delay has
passed (a heap of due times; a pair's delay is constant, so nothing of one pair is reordered)::

    dc0: app -> route 10.213.0.101 dev wan1 -> [tbf/htb on wan1] -> fd ─┐
                                                                        forwarder: hold one-way delay
    dc1: app <- wan1 (delivered as received from the WAN) <──── fd <────┘

Bandwidth stays the kernel's: the tbf/htb of :mod:`isthmus.launch.emulate.network` sits on the TUN's
egress, so a packet is first serialised at the link rate, then propagates for the delay, as on a
real link. The forwarder is stdlib Python, one process: the packets it can move per second bound
the WAN rates worth emulating with latency (:data:`DELAY_LINE_CEILING_MBIT`; its ceiling, measured
by ``benchmarks/wan_latency.py``, is in docs/benchmarks.md).

It enters each datacenter's namespace only to attach to that TUN (``setns``), then returns to the
``-wan`` namespace, so the emulator's teardown and its reaper stop it with that namespace's
processes (:func:`isthmus.launch.netns.kill_namespace_processes`). The emulator also watches it:
ranks whose WAN stopped moving would only wait in their collectives, so its death stops the run
and names it (:class:`isthmus.launch.emulate.HelperDied`).
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import json
import os
import select
import signal
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

TUN_IFNAME = "wan1"
"""The TUN device in each datacenter's namespace that carries traffic to the other datacenters."""
DELAY_LINE_CEILING_MBIT = 400.0
"""Rates above this may not be reached through the delay line (below its ceiling on busy cores: docs/benchmarks.md)."""
NETNS_DIR = Path("/run/netns")
"""Where ``ip netns add`` pins the namespaces it names."""

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000  # bare IP packets, no 4-byte protocol header (as `ip tuntap add` makes them)
_CLONE_NEWNET = 0x40000000
_READ_BATCH = 64  # packets read from one TUN before due packets are sent again: delays stay exact under load
_MAX_HELD_BYTES = 256 << 20  # beyond this the line drops, as a full router queue would


@dataclass(frozen=True)
class DelayLineSpec:
    """What the forwarder connects: one TUN per datacenter and the one-way delay of every pair."""

    namespaces: list[str]
    """Datacenter i's namespace, where its TUN ``TUN_IFNAME`` lives."""
    addresses: list[str]
    """Datacenter i's IPv4 address: packets to it go out of its TUN."""
    delay_s: list[list[float]]
    """``delay_s[i][j]``: seconds a packet from datacenter i to j is held."""

    def to_json(self) -> str:
        return json.dumps({"namespaces": self.namespaces, "addresses": self.addresses, "delay_s": self.delay_s})

    @classmethod
    def from_json(cls, text: str) -> DelayLineSpec:
        raw = json.loads(text)
        return cls(list(raw["namespaces"]), list(raw["addresses"]), [list(row) for row in raw["delay_s"]])


def delay_line_argv(spec: DelayLineSpec) -> list[str]:
    """The command that runs the forwarder of ``spec`` (start it inside the ``-wan`` namespace)."""
    return [sys.executable, "-m", "isthmus.launch.delayline", spec.to_json()]


def _setns(fd: int) -> None:
    # os.setns is Python 3.12+; the libc call is the same thing.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def attach_tun(namespace: str, ifname: str = TUN_IFNAME) -> int:
    """Open the TUN ``ifname`` of ``namespace`` (made there by ``ip tuntap add``); returns its fd.

    A TUN is found by name in the caller's namespace, so this process enters ``namespace`` for the
    attach and returns to its own; the fd keeps working from there.
    """
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(NETNS_DIR / namespace, os.O_RDONLY)
    try:
        _setns(target)
        try:
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", ifname.encode(), _IFF_TUN | _IFF_NO_PI))
        finally:
            _setns(home)
    finally:
        os.close(target)
        os.close(home)
    return fd


def forward(fds: list[int], addresses: list[bytes], delay_s: list[list[float]]) -> None:
    """Move packets between the TUNs ``fds`` (datacenter i's is ``fds[i]``) until killed.

    A packet read from datacenter i's TUN for address ``addresses[j]`` is written to ``fds[j]``
    ``delay_s[i][j]`` seconds after it was read. Anything else (not IPv4, to no datacenter) is
    dropped: only the datacenters' own addresses are routed into the TUNs.
    """
    to_dc = {a: j for j, a in enumerate(addresses)}
    src_of = {fd: i for i, fd in enumerate(fds)}
    held: list[tuple[float, int, int, bytes]] = []  # (due, sequence, out fd, packet); sequence keeps FIFO
    held_bytes = seq = 0
    while True:
        # select's timeout has microseconds (epoll's and poll's have milliseconds): the delay is kept
        # to within the scheduler's wake-up time.
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
        ready, _, _ = select.select(fds, [], [], timeout)
        for fd in ready:
            src = src_of[fd]
            now = time.monotonic()
            for _ in range(_READ_BATCH):
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                dst = to_dc.get(packet[16:20]) if len(packet) >= 20 and packet[0] >> 4 == 4 else None
                if dst is None or dst == src or held_bytes + len(packet) > _MAX_HELD_BYTES:
                    continue
                heapq.heappush(held, (now + delay_s[src][dst], seq, fds[dst], packet))
                held_bytes += len(packet)
                seq += 1
        now = time.monotonic()
        while held and held[0][0] <= now:
            _, _, out, packet = heapq.heappop(held)
            held_bytes -= len(packet)
            try:
                os.write(out, packet)
            except OSError:  # the receiving side dropped it (its backlog is full): a lost packet, as on a WAN
                pass


def main(argv: list[str]) -> int:
    (text,) = argv
    spec = DelayLineSpec.from_json(text)
    # The emulator's teardown decides when this ends; a Ctrl-C meant for the emulate process does not.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fds = [attach_tun(ns) for ns in spec.namespaces]
    sys.stdout.write("ready\n")  # the emulator waits for this line before any rank starts
    sys.stdout.flush()
    forward(fds, [bytes(map(int, a.split("."))) for a in spec.addresses], spec.delay_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
