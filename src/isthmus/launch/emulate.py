"""Emulated datacenters on one machine: one network namespace per datacenter, WAN links shaped by tc
and delayed by a user-space delay line.

`isthmus emulate --topology FILE -- train ...` lands here. The picture for N datacenters::

    ist-<id>-dc0 [wan0 10.213.0.100] ──veth──┐
    ist-<id>-dc1 [wan0 10.213.0.101] ──veth──┤ br0 in ist-<id>-wan
    ...                                      ┘

Each datacenter's ranks run inside its namespace, with gloo bound to ``wan0``. Traffic between
ranks of one datacenter goes to the namespace's own address and stays on its loopback: unshaped.
Traffic to another datacenter leaves through ``wan0``, whose egress qdisc limits it to the WAN
rate (``tbf``; ``htb`` with one class per destination when rates differ per pair).

Latency (``EmulatedNetwork.wan_rtt_ms``, from the topology's WAN ``latency_us`` or ``isthmus
emulate --wan-rtt-ms``): ``tc netem`` is unavailable on the kernel this was built on, so when a
round-trip time is set each datacenter also gets a TUN device ``wan1`` that routes the other
datacenters' addresses, shaped by the same qdiscs, and a forwarder in the ``-wan`` namespace
holds each packet for half the pair's RTT before delivering it into the destination's TUN
(:mod:`isthmus.launch.delayline`, which gives its throughput ceiling). Only traffic between
datacenters is delayed: a fault-tolerant run's Lighthouse, on the bridge, is reached through
``wan0`` at once. With RTT 0 (the default) none of this exists and traffic takes ``wan0`` straight.

Everything made here (namespaces, bridge, veths, qdiscs, the hosts files of ``/etc/netns``, the
files the run's processes had in ``/dev/shm``) is removed on exit, on an exception, on SIGINT /
SIGTERM / SIGHUP; when this process is killed with SIGKILL, its reaper (:mod:`isthmus.launch.reaper`,
started with the network) stops the run's processes and removes it. The root namespace is never touched.

The helpers this process starts (the reaper, the delay line, the rendezvous store or torchft
Lighthouse, each datacenter's agent) are watched while the run goes on: none of them ends by itself
before the run does, and the ranks cannot tell that one has gone (a dead delay line only makes their
collectives wait, until the group timeout blames a rank). When one dies, every datacenter is
stopped at once and :class:`HelperDied` names it; under ``geo.fault_tolerant`` a datacenter whose
agent died is lost as when its ranks fail, and the others train on.

What a rank reads to know where it runs (set by :func:`launch_emulated` for every rank):

- ``ISTHMUS_DC_INDEX``: this rank's datacenter, 0..N-1 (authoritative).
- ``ISTHMUS_N_DC``: N; ``ISTHMUS_DC_NAME``: the datacenter's name.
- ``ISTHMUS_DC_RANKS``: ranks in this datacenter; ``ISTHMUS_DC_LAYOUT``: ranks of every
  datacenter in order, comma-separated (``"2,2"``).

torchrun's c10d rendezvous sorts nodes by their ``--local-addr``; the addresses here sort in
datacenter order, so ``GROUP_RANK == ISTHMUS_DC_INDEX`` and the global ranks of datacenter ``i``
are the contiguous block starting at ``sum(layout[:i])``: ``RANK = start + LOCAL_RANK``.

The rendezvous store of that job is served by a process of its own in dc0's namespace, not by
dc0's agent: after the agents' exit barrier each agent still closes the rendezvous in the store,
and an agent that hosted it would take it away as it exits while another is still closing (a C++
"Connection reset by peer" trace on a run that succeeded; pytorch/pytorch#69520). Started before
the agents and stopped after the last of them, the store outlives them all.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from isthmus.errors import ConfigError, RunFailed
from isthmus.launch import netns
from isthmus.launch.delayline import DELAY_LINE_CEILING_MBIT, TUN_IFNAME, DelayLineSpec, delay_line_argv
from isthmus.launch.reaper import dismiss_reaper, start_reaper
from isthmus.log import get_logger

# These addresses live only inside the namespaces made here: no route to or from the root
# namespace or any other network exists, so nothing outside can be reached or collide with them.
SUBNET = "10.213.0"
_FIRST_HOST = 100  # three-digit host parts: address strings sort in datacenter order (see top)
MAX_DATACENTERS = 154
MIN_WINDOW_KIB, MAX_WINDOW_KIB = 16, 65536
"""The TCP window a namespace may be limited to (``--wan-window-kib``)."""
MAX_RTT_MS = 10_000.0
"""The largest round-trip time accepted: beyond it TCP's and gloo's timeouts, not the WAN, would decide."""
DC_IFNAME = "wan0"
"""The veth inside each datacenter's namespace (bind gloo here: GLOO_SOCKET_IFNAME)."""
BRIDGE = "br0"
RDZV_PORT = 29400
LIGHTHOUSE_ADDRESS = f"{SUBNET}.1"
"""The torchft Lighthouse of a fault-tolerant run: on the bridge, in no datacenter, so any may die."""
LIGHTHOUSE_PORT = 29510
PROBE_PORT = 5201
HELPER_DEATH_GRACE_S = 2.0
"""How long ranks get to stop on SIGTERM once a helper died: those in a collective cannot (the WAN
or a peer they wait for is gone), and nothing they could still finish is worth a longer wait."""


@dataclass
class EmulatedDatacenter:
    """One datacenter to emulate."""

    name: str
    """Its name in logs and ``ISTHMUS_DC_NAME``."""
    ranks: int
    """Ranks (worker processes) it runs."""


@dataclass
class EmulatedNetwork:
    """Datacenters and the WAN between them, in plain numbers (the topology file maps onto this)."""

    datacenters: list[EmulatedDatacenter]
    """In order: datacenter i is torchrun node i and gets address 10.213.0.(100+i)."""
    wan_mbit: float
    """Bandwidth of every inter-datacenter link, each direction, Mbit/s."""
    wan_mbit_per_pair: dict[tuple[int, int], float] | None = None
    """Overrides for traffic from datacenter i to j; (i, j) alone also sets j -> i."""
    wan_rtt_ms: float = 0.0
    """Round-trip time of every inter-datacenter link, ms (half of it each way); 0: no delay line."""
    wan_rtt_ms_per_pair: dict[tuple[int, int], float] | None = None
    """Overrides of the RTT between datacenters i and j (both directions)."""
    wan_window_kib: int = 0
    """Largest TCP window in each datacenter, KiB (``net.ipv4.tcp_rmem`` / ``tcp_wmem`` maxima set
    in its namespace); 0: the kernel's autotuning. A flow then carries at most window / RTT, as one
    flow across regions does when its window, not the link, is the limit."""

    def __post_init__(self) -> None:
        n = len(self.datacenters)
        if not 1 <= n <= MAX_DATACENTERS:
            raise ConfigError("emulate.datacenters", n, f"between 1 and {MAX_DATACENTERS} datacenters")
        for dc in self.datacenters:
            if dc.ranks < 1:
                raise ConfigError(f"emulate.datacenters.{dc.name}.ranks", dc.ranks, "must be >= 1")
        if not self.wan_mbit > 0:
            raise ConfigError("emulate.wan_mbit", self.wan_mbit, "must be > 0 Mbit/s")
        for (i, j), rate in (self.wan_mbit_per_pair or {}).items():
            if not (0 <= i < n and 0 <= j < n and i != j):
                raise ConfigError(
                    "emulate.wan_mbit_per_pair", (i, j), f"needs two different datacenter indices in 0..{n - 1}"
                )
            if not rate > 0:
                raise ConfigError(f"emulate.wan_mbit_per_pair[{i},{j}]", rate, "must be > 0 Mbit/s")
        if not 0 <= self.wan_rtt_ms <= MAX_RTT_MS:
            raise ConfigError("emulate.wan_rtt_ms", self.wan_rtt_ms, f"must be between 0 and {MAX_RTT_MS:g} ms")
        if self.wan_window_kib and not MIN_WINDOW_KIB <= self.wan_window_kib <= MAX_WINDOW_KIB:
            raise ConfigError(
                "emulate.wan_window_kib",
                self.wan_window_kib,
                f"must be 0 (autotuned) or between {MIN_WINDOW_KIB} and {MAX_WINDOW_KIB} KiB",
            )
        for (i, j), rtt in (self.wan_rtt_ms_per_pair or {}).items():
            if not (0 <= i < n and 0 <= j < n and i != j):
                raise ConfigError(
                    "emulate.wan_rtt_ms_per_pair", (i, j), f"needs two different datacenter indices in 0..{n - 1}"
                )
            if not 0 <= rtt <= MAX_RTT_MS:
                raise ConfigError(
                    f"emulate.wan_rtt_ms_per_pair[{i},{j}]", rtt, f"must be between 0 and {MAX_RTT_MS:g} ms"
                )

    def rate_mbit(self, src: int, dst: int) -> float:
        """The shaped rate of traffic from datacenter ``src`` to ``dst``."""
        pairs = self.wan_mbit_per_pair or {}
        return pairs.get((src, dst), pairs.get((dst, src), self.wan_mbit))

    def rtt_ms(self, a: int, b: int) -> float:
        """The round-trip time between datacenters ``a`` and ``b``, ms."""
        pairs = self.wan_rtt_ms_per_pair or {}
        return pairs.get((a, b), pairs.get((b, a), self.wan_rtt_ms))

    @property
    def delayed(self) -> bool:
        """Whether any link has a round-trip time (and so the emulation a delay line)."""
        n = len(self.datacenters)
        return any(self.rtt_ms(i, j) > 0 for i in range(n) for j in range(n) if i != j)

    def distinct_rates_mbit(self) -> list[float]:
        """The WAN rates of this network, slowest first (one value unless rates differ per pair)."""
        n = len(self.datacenters)
        return sorted({self.rate_mbit(i, j) for i in range(n) for j in range(n) if i != j} or {self.wan_mbit})

    @property
    def world_size(self) -> int:
        return sum(dc.ranks for dc in self.datacenters)


@dataclass(frozen=True)
class DatacenterNamespace:
    """A datacenter as made: where its ranks run and how they reach the others."""

    index: int
    name: str
    ranks: int
    namespace: str
    ifname: str
    address: str


def _dc_address(i: int) -> str:
    return f"{SUBNET}.{_FIRST_HOST + i}"


def _how_it_ended(returncode: int) -> str:
    if returncode < 0 and -returncode in signal.valid_signals():
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


@dataclass(frozen=True)
class Helper:
    """A process the emulator started that must run as long as the run does."""

    name: str
    """How a user's error line names it: ``the WAN delay line between dc0 and dc1``."""
    proc: subprocess.Popen[Any]

    def death(self) -> str | None:
        """``<name> (pid N) died (killed by SIGKILL)`` once it has ended; None while it runs."""
        code = self.proc.poll()
        return None if code is None else f"{self.name} (pid {self.proc.pid}) died ({_how_it_ended(code)})"


class HelperDied(RunFailed):
    """A helper of the emulation died during the run; every datacenter was stopped."""

    def __init__(self, death: str) -> None:
        self.death = death
        super().__init__(f"{death}; stopped every datacenter and removed the network")


@dataclass
class Emulation:
    """A live emulated network; made and removed by :func:`emulated_network`."""

    network: EmulatedNetwork
    run_id: str
    dcs: list[DatacenterNamespace]
    _children: list[subprocess.Popen[Any]] = field(default_factory=list, repr=False)
    helpers: list[Helper] = field(default_factory=list)
    """What :meth:`dead_helper` watches (the agents are watched by the launcher: they end when the run does)."""
    _shm: set[Path] = field(default_factory=set, repr=False)

    @property
    def prefix(self) -> str:
        """Every namespace of this run starts with this (``ist-<id>-``)."""
        return netns.run_prefix(self.run_id)

    @property
    def bridge_namespace(self) -> str:
        return f"{self.prefix}wan"

    @property
    def namespaces(self) -> list[str]:
        return [self.bridge_namespace, *(dc.namespace for dc in self.dcs)]

    def dc_env(self, dc_index: int) -> dict[str, str]:
        """What every rank of datacenter ``dc_index`` gets: its interface and where it is."""
        dc = self.dcs[dc_index]
        return {
            "GLOO_SOCKET_IFNAME": dc.ifname,
            "ISTHMUS_DC_INDEX": str(dc.index),
            "ISTHMUS_N_DC": str(len(self.dcs)),
            "ISTHMUS_DC_NAME": dc.name,
            "ISTHMUS_DC_RANKS": str(dc.ranks),
            "ISTHMUS_DC_LAYOUT": ",".join(str(d.ranks) for d in self.dcs),
        }

    def run_in(
        self, dc_index: int, argv: Sequence[str], env: dict[str, str] | None = None, **popen: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` inside datacenter ``dc_index``'s namespace; ``env`` adds to this process's.

        The child gets its own session (a Ctrl-C at the terminal reaches only this process, which
        then stops the children in order) and is stopped at teardown if still running.
        """
        popen.setdefault("start_new_session", True)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.dcs[dc_index].namespace, *argv], env={**os.environ, **(env or {})}, **popen
        )
        self._children.append(proc)
        return proc

    def dead_helper(self) -> str | None:
        """The first helper that has died, as :meth:`Helper.death` says it; None while all run."""
        return next((d for h in self.helpers if (d := h.death()) is not None), None)

    def stop_orphans(self, agent: subprocess.Popen[Any]) -> None:
        """SIGKILL the ranks of an agent that died (noting their /dev/shm files first, as :meth:`stop`):
        they are in its process group (run_in's session), which outlives its leader while they run,
        so its number names no one else's group."""
        self._shm |= netns.shared_memory_files(self.prefix)
        try:
            os.killpg(agent.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, procs: Sequence[subprocess.Popen[Any]], grace_s: float) -> None:
        """:func:`stop_process_groups`, noting first what the run's processes hold in /dev/shm: a
        process killed with SIGKILL (multiprocessing's resource tracker among them) removes nothing
        there, and :meth:`close` removes it instead."""
        self._shm |= netns.shared_memory_files(self.prefix)
        stop_process_groups(procs, grace_s)

    def close(self) -> None:
        """Stop the children, then remove every namespace of this run (veths and qdiscs go with them)
        and the files its processes left in /dev/shm."""
        self.stop(self._children, grace_s=3.0)
        netns.delete_prefix(self.prefix, self._shm)
        netns.unregister_run(self.run_id)


def stop_process_groups(procs: Sequence[subprocess.Popen[Any]], grace_s: float) -> None:
    """SIGTERM each child's process group, SIGKILL what is left after ``grace_s``; reap the children."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        running = [p for p in procs if p.poll() is None]
        if not running:
            return
        for p in running:
            try:
                if os.getpgid(p.pid) == p.pid:  # its own group (run_in's default): reach its children too
                    os.killpg(p.pid, sig)
                else:
                    p.send_signal(sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait_s
        for p in running:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


@contextmanager
def _signals_raise() -> Iterator[None]:
    """Turn SIGINT into KeyboardInterrupt and SIGTERM/SIGHUP into SystemExit(128+sig), so finally runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: object) -> None:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextmanager
def _signals_ignored() -> Iterator[None]:
    """Teardown runs to the end: a second Ctrl-C must not leave half the namespaces behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in sigs}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _rate(mbit: float) -> str:
    return f"{int(mbit * 1e6)}bit"


def _burst_bytes(mbit: float) -> int:
    # At least 2 ms of traffic (a 1000 Hz kernel refills tokens per tick) and a few full frames;
    # small enough that a multi-megabyte transfer sees the configured rate, not the burst.
    return max(32 * 1024, int(mbit * 1e6 / 8 * 0.002))


def _shape(
    net: EmulatedNetwork, dc: DatacenterNamespace, dcs: list[DatacenterNamespace], dev: str | None = None
) -> None:
    """Limit what leaves ``dc`` for other datacenters through ``dev`` (default: its veth) to the WAN rate."""
    ns, dev = dc.namespace, dev or dc.ifname
    others = [d for d in dcs if d.index != dc.index]
    rates = {d.index: net.rate_mbit(dc.index, d.index) for d in others}
    if not others:
        return
    if all(r == net.wan_mbit for r in rates.values()):
        burst = _burst_bytes(net.wan_mbit)
        netns.sh(
            "tc",
            "-n",
            ns,
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            _rate(net.wan_mbit),
            "burst",
            str(burst),
            "latency",
            "100ms",
        )
        return
    netns.sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
    classes = [(1, net.wan_mbit, None)] + [(10 + d.index, rates[d.index], d.address) for d in others]
    for minor, mbit, dst in classes:
        bucket = str(_burst_bytes(mbit))
        quantum = str(min(200_000, max(1514, int(mbit * 1e6 / 8 / 10))))
        netns.sh(
            "tc",
            "-n",
            ns,
            "class",
            "add",
            "dev",
            dev,
            "parent",
            "1:",
            "classid",
            f"1:{minor:x}",
            "htb",
            "rate",
            _rate(mbit),
            "ceil",
            _rate(mbit),
            "burst",
            bucket,
            "cburst",
            bucket,
            "quantum",
            quantum,
        )
        if dst is not None:
            netns.sh(
                "tc",
                "-n",
                ns,
                "filter",
                "add",
                "dev",
                dev,
                "parent",
                "1:",
                "protocol",
                "ip",
                "prio",
                "1",
                "u32",
                "match",
                "ip",
                "dst",
                f"{dst}/32",
                "flowid",
                f"1:{minor:x}",
            )


def _build(em: Emulation) -> None:
    wan = em.bridge_namespace
    netns.add_namespace(wan)
    netns.sh("ip", "-n", wan, "link", "add", BRIDGE, "type", "bridge")
    netns.sh("ip", "-n", wan, "link", "set", BRIDGE, "up")
    for dc in em.dcs:
        netns.add_namespace(dc.namespace)
        # Both ends are made inside our namespaces: nothing appears in the root namespace.
        port = f"dc{dc.index}"
        netns.sh("ip", "-n", wan, "link", "add", port, "type", "veth", "peer", "name", dc.ifname, "netns", dc.namespace)
        netns.sh("ip", "-n", wan, "link", "set", port, "master", BRIDGE, "up")
        netns.sh("ip", "-n", dc.namespace, "addr", "add", f"{dc.address}/24", "dev", dc.ifname)
        netns.sh("ip", "-n", dc.namespace, "link", "set", dc.ifname, "up")
        _shape(em.network, dc, em.dcs)
        if em.network.delayed:
            _add_delay_route(em, dc)
        if em.network.wan_window_kib:
            # Per-namespace sysctls: the root namespace's TCP settings are untouched.
            window = str(em.network.wan_window_kib * 1024)
            for key in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
                netns.sh("ip", "netns", "exec", dc.namespace, "sysctl", "-q", "-w", f"{key}=4096 {window} {window}")
    # Names for every address here, so that servers in the namespaces need no DNS (see write_hosts).
    names = {dc.address: dc.namespace for dc in em.dcs} | {LIGHTHOUSE_ADDRESS: f"{em.prefix}lighthouse"}
    for ns in em.namespaces:
        netns.write_hosts(ns, names)


def _add_delay_route(em: Emulation, dc: DatacenterNamespace) -> None:
    """Send ``dc``'s traffic for the other datacenters into its TUN (the delay line's input), shaped there.

    A /32 route per peer beats the bridge's /24; the ``src`` keeps the datacenter's one address
    (torchrun and gloo announce it). The TUN is persistent, so it and its routes exist before the
    forwarder attaches; packets arriving from the forwarder are delivered as if from the WAN.
    """
    ns = dc.namespace
    netns.sh("ip", "-n", ns, "tuntap", "add", "dev", TUN_IFNAME, "mode", "tun")
    netns.sh("ip", "-n", ns, "link", "set", TUN_IFNAME, "up")
    for other in em.dcs:
        if other.index != dc.index:
            netns.sh("ip", "-n", ns, "route", "add", f"{other.address}/32", "dev", TUN_IFNAME, "src", dc.address)
    _shape(em.network, dc, em.dcs, dev=TUN_IFNAME)


def _between(names: list[str]) -> str:
    return " and ".join(names) if len(names) <= 2 else f"{', '.join(names[:-1])} and {names[-1]}"


def start_delay_line(em: Emulation) -> None:
    """Start the forwarder that delays the WAN (:mod:`isthmus.launch.delayline`) in the bridge's
    namespace; it is stopped with the emulation's other children, and with that namespace's processes."""
    n = len(em.dcs)
    spec = DelayLineSpec(
        namespaces=[dc.namespace for dc in em.dcs],
        addresses=[dc.address for dc in em.dcs],
        delay_s=[[em.network.rtt_ms(i, j) / 2e3 if i != j else 0.0 for j in range(n)] for i in range(n)],
    )
    name = f"the WAN delay line between {_between([dc.name for dc in em.dcs])}"
    line = _serve(em, em.bridge_namespace, delay_line_argv(spec), "WAN delay line", name)
    if line != "ready":
        raise RuntimeError(f"the WAN delay line did not start in {em.bridge_namespace}: {line}")


@contextmanager
def emulated_network(net: EmulatedNetwork, clean_stale: bool = True) -> Iterator[Emulation]:
    """Make the namespaces, bridge, veths and qdiscs of ``net`` (and its delay line when it has an
    RTT); remove them all on the way out.

    ``clean_stale`` first removes namespaces left by emulator runs whose process is gone.
    """
    netns.require_root()
    if clean_stale:
        netns.cleanup_stale()
    run_id = netns.new_run_id()
    prefix = netns.run_prefix(run_id)
    dcs = [
        DatacenterNamespace(i, dc.name, dc.ranks, f"{prefix}dc{i}", DC_IFNAME, _dc_address(i))
        for i, dc in enumerate(net.datacenters)
    ]
    em = Emulation(net, run_id, dcs)
    log = get_logger()
    with _signals_raise():
        reaper = None
        try:
            netns.register_run(run_id)
            # Before anything is made: whatever exists of the run when this process dies is reaped.
            reaper = start_reaper(run_id)
            em.helpers.append(Helper("the emulator's reaper", reaper))
            _build(em)
            if net.delayed:
                start_delay_line(em)
                if max(net.distinct_rates_mbit()) > DELAY_LINE_CEILING_MBIT:
                    log.warning(
                        "WAN rates above %g Mbit/s may not be reached with latency: the delay line is one "
                        "Python process (about 500-800 Mbit/s on 2 shared cores)",
                        DELAY_LINE_CEILING_MBIT,
                    )
            n = len(dcs)
            rtts = sorted({net.rtt_ms(i, j) for i in range(n) for j in range(n) if i != j} or {net.wan_rtt_ms})
            log.info(
                "emulated %d datacenter(s) in namespaces %s*: %s; WAN %s Mbit/s, RTT %s ms%s",
                n,
                prefix,
                ", ".join(f"{d.name}={d.address} x{d.ranks}" for d in dcs),
                "/".join(f"{r:g}" for r in net.distinct_rates_mbit()),
                "/".join(f"{r:g}" for r in rtts),
                " (user-space delay line)" if net.delayed else "",
            )
            yield em
        finally:
            with _signals_ignored():
                em.close()
                if reaper is not None:
                    dismiss_reaper(reaper)


# A bounded one-connection TCP sink and source; stdlib only, each ends by its own deadline.
_PROBE_SERVER = r"""
import json, socket, sys, time
addr, port, n, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
deadline = time.monotonic() + limit
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((addr, port)); srv.listen(1); srv.settimeout(limit)
print("ready", flush=True)
got = first = 0; t0 = t1 = 0.0
try:
    conn, _ = srv.accept()
    while got < n and time.monotonic() < deadline:
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        b = conn.recv(1 << 20)
        if not b:
            break
        now = time.monotonic()
        if not got:
            t0, first = now, len(b)
        got += len(b); t1 = now
except (socket.timeout, OSError):
    pass
print(json.dumps({"bytes": got, "first": first, "seconds": t1 - t0}), flush=True)
"""

_PROBE_CLIENT = r"""
import socket, sys, time
addr, port, n, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
deadline = time.monotonic() + limit
buf = bytes(1 << 16); sent = 0
try:
    c = socket.create_connection((addr, port), timeout=limit)
    while sent < n and time.monotonic() < deadline:
        c.settimeout(max(0.01, deadline - time.monotonic()))
        k = min(len(buf), n - sent); c.sendall(buf[:k]); sent += k
    c.close()
except (socket.timeout, OSError):
    pass
"""


def throughput_probe(
    em: Emulation,
    src_dc: int,
    dst_dc: int,
    n_bytes: int = 5_000_000,
    time_limit_s: float = 10.0,
    port: int = PROBE_PORT,
) -> float:
    """Bits/s of one TCP transfer of ``n_bytes`` from datacenter ``src_dc`` to ``dst_dc``.

    Timed at the receiver from the first chunk to the last (the first chunk's bytes are not
    counted: they arrived at the start instant). Bounded by ``time_limit_s``: a slower link gives
    the rate of what got through in that time. ``src_dc == dst_dc`` measures the namespace's own
    (loopback) path.
    """
    dst = em.dcs[dst_dc].address
    args = [dst, str(port), str(n_bytes), str(time_limit_s)]
    server = em.run_in(dst_dc, [sys.executable, "-c", _PROBE_SERVER, *args], stdout=subprocess.PIPE, text=True)
    client = None
    try:
        assert server.stdout is not None
        ready, _, _ = select.select([server.stdout], [], [], 10.0)
        if not ready or server.stdout.readline().strip() != "ready":
            raise RuntimeError(f"throughput probe: no listener in {em.dcs[dst_dc].namespace}")
        client = em.run_in(src_dc, [sys.executable, "-c", _PROBE_CLIENT, *args])
        out, _ = server.communicate(timeout=time_limit_s + 10)
        client.wait(timeout=10)
    finally:
        stop_process_groups([p for p in (server, client) if p is not None], grace_s=1.0)
    result = json.loads(out.strip().splitlines()[-1])
    counted, seconds = result["bytes"] - result["first"], result["seconds"]
    if counted <= 0 or seconds <= 0:
        raise RuntimeError(f"throughput probe dc{src_dc} -> dc{dst_dc}: too little arrived to time ({result})")
    return counted * 8 / seconds


def torchrun_argv(
    em: Emulation, dc_index: int, train_argv: Sequence[str], script: str | None = None, rdzv_port: int = RDZV_PORT
) -> list[str]:
    """The elastic agent of datacenter ``dc_index``: node ``dc_index`` of an N-node c10d job
    (torchrun's, through :mod:`isthmus.launch.agent`).

    The c10d store listens on dc0's address, served by :func:`serve_rendezvous_store`: no agent
    hosts it (``is_host=0``; inside a namespace the hostname heuristic could not tell anyway).
    ``--local-addr`` makes the workers' MASTER_ADDR dc0's address and orders the nodes (see the
    module docstring). ``--node-rank`` is not passed: c10d ignores it.
    """
    dc, dc0 = em.dcs[dc_index], em.dcs[0]
    target = ["-m", "isthmus"] if script is None else [script]
    return [
        sys.executable,
        "-m",
        "isthmus.launch.agent",  # torchrun, quiet about its exit
        "--nnodes",
        str(len(em.dcs)),
        "--nproc-per-node",
        str(dc.ranks),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{dc0.address}:{rdzv_port}",
        "--rdzv-id",
        f"isthmus-{em.run_id}",
        "--rdzv-conf",
        "is_host=0",
        "--local-addr",
        dc.address,
        "--max-restarts",
        "0",
        *target,
        *train_argv,
    ]


def torchrun_dc_job_argv(
    em: Emulation, dc_index: int, train_argv: Sequence[str], max_restarts: int, rdzv_port: int = RDZV_PORT
) -> list[str]:
    """Datacenter ``dc_index`` as a job of its own (``geo.fault_tolerant``): one node, its own c10d
    store on its own address, and torch's elastic restarts of its ranks (up to ``max_restarts``),
    which then rejoin the others through torchft."""
    dc = em.dcs[dc_index]
    return [
        sys.executable,
        "-m",
        "isthmus.launch.agent",  # torchrun, quiet about its exit
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(dc.ranks),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{dc.address}:{rdzv_port}",
        "--rdzv-id",
        f"isthmus-{em.run_id}-dc{dc_index}",
        "--rdzv-conf",
        "is_host=1",
        "--local-addr",
        dc.address,
        "--max-restarts",
        str(max_restarts),
        "-m",
        "isthmus",
        *train_argv,
    ]


_LIGHTHOUSE = r"""
import sys, time
from isthmus.geo.fault import start_lighthouse
lh = start_lighthouse(sys.argv[1], int(sys.argv[2]), heartbeat_timeout_ms=int(sys.argv[3]), join_timeout_ms=int(sys.argv[4]))
print(lh.address, flush=True)
while True:
    time.sleep(3600)
"""

# The store of the c10d rendezvous of one job over every datacenter, in a process of its own (see
# the module docstring). multi_tenant as torchrun's own (the agent's workers may share it).
_RDZV_STORE = r"""
import sys, time
from torch.distributed import TCPStore
store = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, wait_for_workers=False, multi_tenant=True)
print("ready", flush=True)
while True:
    time.sleep(3600)
"""


def _serve(em: Emulation, namespace: str, argv: Sequence[str], what: str, name: str) -> str:
    """Start ``argv`` in ``namespace`` as a helper of the emulation called ``name`` (watched while the
    run goes on, stopped with the others at teardown) and return the first line it prints, which says
    it is ready."""
    proc = subprocess.Popen(
        ["ip", "netns", "exec", namespace, *argv],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    em._children.append(proc)
    em.helpers.append(Helper(name, proc))
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60.0)
    line = proc.stdout.readline().strip() if ready else ""
    if not line:
        raise RuntimeError(f"the {what} did not start in {namespace} (exit code {proc.poll()})")
    return line


def serve_lighthouse(
    em: Emulation, heartbeat_timeout_ms: int = 5000, join_timeout_ms: int = 10000, port: int = LIGHTHOUSE_PORT
) -> str:
    """Start a torchft Lighthouse on the bridge (``LIGHTHOUSE_ADDRESS``, given to the bridge here)
    and return its ``http://`` address; it is stopped with the emulation's other children."""
    wan = em.bridge_namespace
    netns.sh("ip", "-n", wan, "addr", "add", f"{LIGHTHOUSE_ADDRESS}/24", "dev", BRIDGE)
    args = [LIGHTHOUSE_ADDRESS, str(port), str(heartbeat_timeout_ms), str(join_timeout_ms)]
    line = _serve(em, wan, [sys.executable, "-c", _LIGHTHOUSE, *args], "torchft lighthouse", "the torchft lighthouse")
    if not line.startswith("http://"):
        raise RuntimeError(f"the torchft lighthouse did not start in {wan}: {line}")
    return line


def serve_rendezvous_store(em: Emulation, port: int = RDZV_PORT) -> None:
    """Serve the agents' c10d rendezvous store on dc0's address until the emulation's teardown,
    which stops it after every agent has exited."""
    argv = [sys.executable, "-c", _RDZV_STORE, em.dcs[0].address, str(port)]
    _serve(em, em.dcs[0].namespace, argv, "rendezvous store", f"the agents' rendezvous store in {em.dcs[0].name}")


def _agent_death(em: Emulation, procs: list[subprocess.Popen[Any]]) -> tuple[int, str] | None:
    """(index, what died) of the first datacenter whose agent was killed by a signal: its ranks are
    left without it, and nobody else would stop them; an agent that exits (even with a failure) says
    its ranks' end and is not a death."""
    for i, p in enumerate(procs):
        code = p.poll()
        if code is not None and code < 0:
            return i, Helper(f"the torchrun agent of {em.dcs[i].name}", p).death() or ""
    return None


def _wait_all(em: Emulation, procs: list[subprocess.Popen[Any]], timeout_s: float | None, grace_s: float) -> int:
    """geo.fault_tolerant: a datacenter that fails does not stop the others; wait for every one.

    Returns 0 when at least one datacenter completed (the run survived), else the first failure's code.
    Raises :class:`HelperDied` when a helper of the emulation died (the Lighthouse, the delay line)."""
    log = get_logger()
    names = [dc.name for dc in em.dcs]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    reported: set[int] = set()
    death = None
    try:
        while True:
            death = em.dead_helper()
            if death is not None:
                break
            codes = [p.poll() for p in procs]
            for i, c in enumerate(codes):
                if c not in (None, 0) and i not in reported:
                    reported.add(i)
                    if c < 0:  # its agent was killed: a datacenter lost, as when its ranks fail
                        em.stop_orphans(procs[i])
                        ended = f"{Helper(f'the torchrun agent of {names[i]}', procs[i]).death()}; stopped its ranks"
                    else:
                        ended = f"datacenter {names[i]} ended with exit code {c}"
                    others = [n for j, n in enumerate(names) if codes[j] is None]
                    log.warning(
                        "%s; %s train on", ended, ", ".join(others) if others else "no other datacenter is running to"
                    )
            if all(c is not None for c in codes):
                done = [n for n, c in zip(names, codes) if c == 0]
                if done:
                    if reported:
                        log.info("the run survived: %s completed", ", ".join(done))
                    return 0
                return next(c for c in codes if c)
            if deadline is not None and time.monotonic() > deadline:
                log.error("emulated run passed its %ss limit: stopping every datacenter", timeout_s)
                rc = 124
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        rc = 128 + signal.SIGINT
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    with _signals_ignored():
        em.stop(procs, grace_s if death is None else HELPER_DEATH_GRACE_S)
    if death is not None:
        raise HelperDied(death)
    return rc


def _wait_first_failure(
    em: Emulation, procs: list[subprocess.Popen[Any]], timeout_s: float | None, grace_s: float
) -> int:
    """Wait for every agent; on the first non-zero exit, Ctrl-C, SIGTERM or timeout stop the rest.

    Raises :class:`HelperDied` when a helper of the emulation or an agent died."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    rc = 0
    death = None
    try:
        while True:
            death = em.dead_helper()
            lost = _agent_death(em, procs)
            if lost is not None:
                em.stop_orphans(procs[lost[0]])
                death = death or lost[1]
            if death is not None:
                break
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                rc = failed[0]
                break
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                get_logger().error("emulated run passed its %ss limit: stopping every datacenter", timeout_s)
                rc = 124
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        rc = 128 + signal.SIGINT
    except SystemExit as e:  # SIGTERM / SIGHUP through _signals_raise
        rc = e.code if isinstance(e.code, int) else 1
    with _signals_ignored():
        em.stop(procs, grace_s if death is None else HELPER_DEATH_GRACE_S)
    if death is not None:
        raise HelperDied(death)
    return rc


def launch_emulated(
    net: EmulatedNetwork,
    train_argv: Sequence[str],
    *,
    script: str | None = None,
    env: dict[str, str] | None = None,
    log_dir: str | Path | None = None,
    timeout_s: float | None = None,
    grace_s: float = 10.0,
    rdzv_port: int = RDZV_PORT,
    fault_tolerant: bool = False,
    max_restarts: int = 0,
) -> int:
    """Run ``isthmus <train_argv>`` (or ``script``) on emulated datacenters; return the exit code.

    One torch elastic agent per datacenter, in its namespace, ``nproc_per_node`` = its ranks. The
    first non-zero exit (or Ctrl-C: 130, SIGTERM: 143, ``timeout_s``: 124) stops the others;
    the network is removed in every case. ``log_dir`` takes each agent's output as
    ``<log_dir>/dc<i>.log``; without it, output goes to this process's console.

    ``fault_tolerant`` (``geo.fault_tolerant``): a torchft Lighthouse on the bridge, each datacenter
    a job of its own whose ranks torch restarts up to ``max_restarts`` times (they rejoin from the
    global model); one datacenter's failure stops nothing, and the run succeeds when one completes.
    """
    log = get_logger()
    with emulated_network(net) as em:
        files: list[IO[str]] = []
        procs: list[subprocess.Popen[Any]] = []
        try:
            extra: dict[str, str] = {}
            if fault_tolerant:
                extra["TORCHFT_LIGHTHOUSE"] = serve_lighthouse(em)
                if max_restarts:
                    # As in launch/local.py: restarted ranks must not read the dead ones' gloo
                    # addresses from the agent's shared store (pytorch/pytorch#135712).
                    extra["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
                log.info(
                    "fault tolerant: torchft lighthouse at %s; each datacenter is its own job (restarts: %d)",
                    extra["TORCHFT_LIGHTHOUSE"],
                    max_restarts,
                )
            else:
                serve_rendezvous_store(em, rdzv_port)
            # What torchrun would set (and announce in a banner per agent) when it is not set; each
            # rank then sets its own thread count (isthmus.launch.local).
            extra["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
            for dc in em.dcs:
                out: IO[str] | None = None
                if log_dir is not None:
                    Path(log_dir).mkdir(parents=True, exist_ok=True)
                    out = open(Path(log_dir) / f"dc{dc.index}.log", "w")
                    files.append(out)
                if fault_tolerant:
                    argv = torchrun_dc_job_argv(em, dc.index, train_argv, max_restarts, rdzv_port)
                else:
                    argv = torchrun_argv(em, dc.index, train_argv, script, rdzv_port)
                procs.append(
                    em.run_in(
                        dc.index,
                        argv,
                        env={**em.dc_env(dc.index), **extra, **(env or {})},
                        stdout=out,
                        stderr=subprocess.STDOUT if out else None,
                        text=True,
                    )
                )
            log.info("started %d rank(s) in %d emulated datacenter(s)", net.world_size, len(em.dcs))
            if fault_tolerant:
                rc = _wait_all(em, procs, timeout_s, grace_s)
            else:
                rc = _wait_first_failure(em, procs, timeout_s, grace_s)
        except KeyboardInterrupt:  # while starting
            rc = 128 + signal.SIGINT
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        finally:
            for f in files:
                f.close()
    return rc


__all__ = [
    "DatacenterNamespace",
    "EmulatedDatacenter",
    "EmulatedNetwork",
    "Emulation",
    "Helper",
    "HelperDied",
    "emulated_network",
    "launch_emulated",
    "serve_lighthouse",
    "serve_rendezvous_store",
    "start_delay_line",
    "throughput_probe",
    "torchrun_argv",
]
