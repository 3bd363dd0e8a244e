"""Alpha-beta times of collectives on a group of devices, tier by tier (node, datacenter, WAN).

A group is described by a :class:`Span`: how many of its members share a node, how many nodes of
one datacenter it covers, and how many datacenters. Two algorithms:

- ``hierarchical`` (what NCCL's multi-ring/tree reaches inside a cluster, and the 'hierarchical'
  cross-datacenter strategy): reduce-scatter inside the node, then between nodes on 1/k1 of the
  data, then between datacenters on 1/(k1 k2); all-gather mirrors it. Every member uses its own
  NIC; between datacenters, all members of all concurrent groups share the one WAN link.
- ``ring`` (the 'flat' strategy): one ring through every member, so each of its 2(n-1) steps waits
  for the slowest link it crosses, latency included.

Sizes are bytes of the full (unsharded) buffer; times are seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from isthmus.planner.topology import Link

Algo = str  # "hierarchical" | "ring"


@dataclass(frozen=True)
class Span:
    """Where the members of one communication group sit."""

    per_node: int
    """Members in one node (k1)."""
    nodes: int
    """Nodes of one datacenter the group covers (k2)."""
    dcs: int
    """Datacenters the group covers (k3)."""
    intra: Link
    fabric: Link
    wan: Link | None = None
    """The slowest WAN link of the ring through the group's datacenters."""
    concurrent: int = 1
    """Groups of this shape that cross the WAN at the same time (they share its bandwidth)."""
    streams: int = 1
    """TCP connections each member's WAN transfer is split over (``geo.wan_streams``)."""

    @property
    def size(self) -> int:
        return self.per_node * self.nodes * self.dcs

    @property
    def crosses_wan(self) -> bool:
        return self.dcs > 1

    def tiers(self) -> list[tuple[int, float, float]]:
        """(members, bandwidth per member, latency) of each tier the group spans, inner first."""
        out = []
        if self.per_node > 1:
            out.append((self.per_node, self.intra.bandwidth, self.intra.latency))
        if self.nodes > 1:
            out.append((self.nodes, self.fabric.bandwidth, self.fabric.latency))
        if self.dcs > 1:
            assert self.wan is not None, "a span over datacenters needs its WAN link"
            share = self.per_node * self.nodes * self.concurrent
            # All members' connections at once: the link, or their windows per round trip (`Link.rate`).
            out.append((self.dcs, self.wan.rate(share * self.streams) / share, self.wan.latency))
        return out


def local_span(size: int, link: Link) -> Span:
    """A group of ``size`` devices inside one node."""
    return Span(size, 1, 1, link, link)


def reduce_scatter(nbytes: float, span: Span, algo: Algo = "hierarchical") -> float:
    """Reduce ``nbytes`` over the group, leaving 1/size of the result on each member."""
    if span.size <= 1 or nbytes <= 0:
        return 0.0
    if algo == "ring":
        return _ring_steps(nbytes, span, span.size - 1)
    total, chunk = 0.0, nbytes
    for k, bw, lat in span.tiers():
        total += (k - 1) * lat + (k - 1) / k * chunk / bw
        chunk /= k
    return total


def all_gather(nbytes: float, span: Span, algo: Algo = "hierarchical") -> float:
    """Gather a buffer of ``nbytes`` (each member holds 1/size of it) onto every member."""
    return reduce_scatter(nbytes, span, algo)


def all_reduce(nbytes: float, span: Span, algo: Algo = "hierarchical") -> float:
    """Sum ``nbytes`` over the group onto every member: reduce-scatter then all-gather."""
    if algo == "ring" and span.size > 1 and nbytes > 0:
        return _ring_steps(nbytes, span, 2 * (span.size - 1))
    return 2 * reduce_scatter(nbytes, span, algo)


def all_to_all(nbytes: float, span: Span) -> float:
    """Each member sends ``nbytes`` split evenly over all members; tiers carry their share at once."""
    n = span.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    inner, slowest, lat = 1, 0.0, 0.0
    for k, bw, latency in span.tiers():
        outer = inner * k
        slowest = max(slowest, (outer - inner) / n * nbytes / bw)
        inner, lat = outer, max(lat, latency)
    return (n - 1) * lat + slowest


def p2p(nbytes: float, link: Link, share: int = 1) -> float:
    """One message of ``nbytes`` over ``link`` while ``share`` such messages use it at once."""
    return link.latency + nbytes * share / link.bandwidth if nbytes > 0 else 0.0


def _ring_steps(nbytes: float, span: Span, steps: int) -> float:
    """A single ring: every step moves nbytes/size across the slowest edge, paying its latency."""
    edges = []
    if span.per_node > 1:
        edges.append((span.intra.bandwidth, span.intra.latency))
    if span.nodes > 1:
        edges.append((span.fabric.bandwidth, span.fabric.latency))
    if span.dcs > 1:
        assert span.wan is not None
        edges.append((span.wan.bandwidth / span.concurrent, span.wan.latency))
    bw = min(b for b, _ in edges)
    lat = max(l for _, l in edges)
    return steps * (lat + nbytes / span.size / bw)


def wan_bytes_all_reduce(nbytes: float, span: Span, algo: Algo = "hierarchical") -> float:
    """Bytes one all-reduce of this group sends across datacenter boundaries (all its WAN links)."""
    if span.dcs <= 1:
        return 0.0
    k = span.dcs
    if algo == "ring":
        # 2(n-1) steps of nbytes/n; k of the ring's n edges cross a boundary.
        return 2 * (span.size - 1) * nbytes / span.size * k
    # Each datacenter sends 2 (k-1)/k of the buffer in the cross-datacenter phase.
    return 2 * (k - 1) * nbytes
