"""The emulated network: one namespace per datacenter on a bridge, its WAN links shaped by tc.

The picture for N datacenters::

    ist-<id>-dc0 [wan0 10.213.0.100] ──veth──┐
    ist-<id>-dc1 [wan0 10.213.0.101] ──veth──┤ br0 in ist-<id>-wan
    ...                                      ┘

Traffic between ranks of one datacenter goes to the namespace's own address and stays on its
loopback: unshaped. Traffic to another datacenter leaves through ``wan0``, whose egress qdisc limits
it to the WAN rate (``tbf``; ``htb`` with one class per destination when rates differ per pair).

Latency (``EmulatedNetwork.wan_rtt_ms``): ``tc netem`` is unavailable on the kernel this was built
on, so when a round-trip time is set each datacenter also gets a TUN device ``wan1`` that routes the
other datacenters' addresses, shaped by the same qdiscs, and a forwarder in the ``-wan`` namespace
(:mod:`isthmus.launch.delayline`, started by :func:`isthmus.launch.emulate.services.start_delay_line`)
holds each packet for half the pair's RTT. Only traffic between datacenters is delayed: a
fault-tolerant run's Lighthouse, on the bridge, is reached through ``wan0`` at once. With RTT 0 (the
default) none of this exists and traffic takes ``wan0`` straight.

Both ends of every veth are made inside the run's namespaces: the root namespace is never touched.
"""

from __future__ import annotations

from dataclasses import dataclass

from isthmus.errors import ConfigError
from isthmus.launch import netns
from isthmus.launch.delayline import TUN_IFNAME

# These addresses live only inside the namespaces made here: no route to or from the root
# namespace or any other network exists, so nothing outside can be reached or collide with them.
SUBNET = "10.213.0"
_FIRST_HOST = 100  # three-digit host parts: address strings sort in datacenter order (see the package)
MAX_DATACENTERS = 154
MIN_WINDOW_KIB, MAX_WINDOW_KIB = 16, 65536
"""The TCP window a namespace may be limited to (``--wan-window-kib``)."""
MAX_RTT_MS = 10_000.0
"""The largest round-trip time accepted: beyond it TCP's and gloo's timeouts, not the WAN, would decide."""
DC_IFNAME = "wan0"
"""The veth inside each datacenter's namespace (bind gloo here: GLOO_SOCKET_IFNAME)."""
BRIDGE = "br0"
LIGHTHOUSE_ADDRESS = f"{SUBNET}.1"
"""The torchft Lighthouse of a fault-tolerant run: on the bridge, in no datacenter, so any may die."""


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

    def distinct_rtts_ms(self) -> list[float]:
        """The round-trip times of this network, shortest first (one value unless they differ per pair)."""
        n = len(self.datacenters)
        return sorted({self.rtt_ms(i, j) for i in range(n) for j in range(n) if i != j} or {self.wan_rtt_ms})

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


def bridge_namespace(prefix: str) -> str:
    """The namespace that holds the bridge (and the delay line) of the run whose namespaces start with ``prefix``."""
    return f"{prefix}wan"


def datacenter_namespaces(net: EmulatedNetwork, prefix: str) -> list[DatacenterNamespace]:
    """Where each datacenter of ``net`` will live: its namespace, interface and address."""
    return [
        DatacenterNamespace(i, dc.name, dc.ranks, f"{prefix}dc{i}", DC_IFNAME, member_address(i))
        for i, dc in enumerate(net.datacenters)
    ]


def member_address(index: int) -> str:
    """The address of member ``index`` (a datacenter, or an emulated host) of a bridged run."""
    return f"{SUBNET}.{_FIRST_HOST + index}"


def build_bridge(prefix: str, members: list[tuple[str, str]], port: str = "dc") -> None:
    """Make the bridge's namespace and one namespace per ``(namespace, address)`` of ``members``,
    joined to the bridge by a veth (``DC_IFNAME`` inside, ``<port><i>`` on the bridge) that holds the
    address; ``lo`` and the veth up. Nothing is shaped: :func:`build_network` adds that."""
    wan = bridge_namespace(prefix)
    netns.add_namespace(wan)
    netns.sh("ip", "-n", wan, "link", "add", BRIDGE, "type", "bridge")
    netns.sh("ip", "-n", wan, "link", "set", BRIDGE, "up")
    for i, (namespace, address) in enumerate(members):
        netns.add_namespace(namespace)
        # Both ends are made inside our namespaces: nothing appears in the root namespace.
        peer = f"{port}{i}"
        netns.sh("ip", "-n", wan, "link", "add", peer, "type", "veth", "peer", "name", DC_IFNAME, "netns", namespace)
        netns.sh("ip", "-n", wan, "link", "set", peer, "master", BRIDGE, "up")
        netns.sh("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", DC_IFNAME)
        netns.sh("ip", "-n", namespace, "link", "set", DC_IFNAME, "up")


def build_network(net: EmulatedNetwork, dcs: list[DatacenterNamespace], prefix: str) -> None:
    """Make the bridge's namespace and each datacenter's, a veth between them, its address and
    qdiscs (and its TUN and routes when ``net`` has an RTT); every namespace's hosts file."""
    assert all(dc.ifname == DC_IFNAME for dc in dcs)
    wan = bridge_namespace(prefix)
    build_bridge(prefix, [(dc.namespace, dc.address) for dc in dcs])
    for dc in dcs:
        _shape(net, dc, dcs)
        if net.delayed:
            _add_delay_route(net, dc, dcs)
        if net.wan_window_kib:
            # Per-namespace sysctls: the root namespace's TCP settings are untouched.
            window = str(net.wan_window_kib * 1024)
            for key in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
                netns.sh("ip", "netns", "exec", dc.namespace, "sysctl", "-q", "-w", f"{key}=4096 {window} {window}")
    # Names for every address here, so that servers in the namespaces need no DNS (see write_hosts).
    names = {dc.address: dc.namespace for dc in dcs} | {LIGHTHOUSE_ADDRESS: f"{prefix}lighthouse"}
    for ns in [wan, *(dc.namespace for dc in dcs)]:
        netns.write_hosts(ns, names)


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


def _add_delay_route(net: EmulatedNetwork, dc: DatacenterNamespace, dcs: list[DatacenterNamespace]) -> None:
    """Send ``dc``'s traffic for the other datacenters into its TUN (the delay line's input), shaped there.

    A /32 route per peer beats the bridge's /24; the ``src`` keeps the datacenter's one address
    (torchrun and gloo announce it). The TUN is persistent, so it and its routes exist before the
    forwarder attaches; packets arriving from the forwarder are delivered as if from the WAN.
    """
    ns = dc.namespace
    netns.sh("ip", "-n", ns, "tuntap", "add", "dev", TUN_IFNAME, "mode", "tun")
    netns.sh("ip", "-n", ns, "link", "set", TUN_IFNAME, "up")
    for other in dcs:
        if other.index != dc.index:
            netns.sh("ip", "-n", ns, "route", "add", f"{other.address}/32", "dev", TUN_IFNAME, "src", dc.address)
    _shape(net, dc, dcs, dev=TUN_IFNAME)
