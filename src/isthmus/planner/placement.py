"""Where a layout's groups land on a topology: which links each parallel dimension uses.

Ranks are numbered datacenter by datacenter, node by node. The mesh puts tensor parallelism
innermost (consecutive ranks, so inside a node), then cp, dp_shard, dp_replicate, and pipeline
outermost, like ``ParallelDims``. A datacenter boundary therefore cuts either the pipeline
(``dc_axis = 'pp'``: pp is outermost, each datacenter holds consecutive stages) or an extra
outer data-parallel factor (``dc_axis = 'dp'``: mesh ``dc, pp, dp_replicate/dc, dp_shard, cp, tp``).
Per-layer traffic (tp, cp, sequence parallelism, ZeRO-3 gathers) never leaves a datacenter.

Which datacenters, and how many stages each (Atlas, arXiv 2411.14458): a layout over k of n
datacenters uses the k with the most compute (:func:`choose_dcs`). With
``dc_axis = 'pp'`` every stage keeps all its data-parallel replicas in one datacenter, so only
stage boundaries cross the WAN, and the datacenters take stage counts in proportion to their
compute, within what their devices hold (:func:`stage_counts`): the largest takes the most. The
runtime splits ranks evenly over all the topology's datacenters, so a subset (1 < k < n) or
unequal counts are the planner's what-ifs (:func:`runnable`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from isthmus.errors import ConfigError
from isthmus.layout.spec import LayoutSpec
from isthmus.planner.comm import Span
from isthmus.planner.topology import Datacenter, DeviceKind, Link, Topology


@dataclass(frozen=True)
class SiteSpans:
    """The groups of one datacenter's ranks."""

    dc: Datacenter
    tp: Span
    cp: Span
    shard: Span
    """dp_shard x cp: what ZeRO / FSDP shards over."""
    replicate: Span
    """dp_replicate: across datacenters when dc_axis == 'dp'."""
    sync: Span
    """dp x cp: every rank holding a replica of the same parameters (DDP all-reduce)."""
    pp_link: Link
    """Link between consecutive pipeline ranks inside this datacenter."""
    ep: Span | None = None
    """Expert parallelism: ep consecutive ranks of dp_shard x cp (None: ep 1)."""


@dataclass(frozen=True)
class Placement:
    dcs: tuple[int, ...]
    """Indices (into topology.datacenters) of the datacenters used, in ring / chain order."""
    sites: tuple[SiteSpans, ...]
    """Per used datacenter, same order as dcs."""
    stage_sites: tuple[tuple[int, ...], ...]
    """Per pipeline rank, the positions in ``sites`` that run it (all of them unless dc_axis == 'pp')."""
    boundary_links: tuple[tuple[Link, int, bool], ...]
    """Per pipeline boundary r -> r+1: (link, messages sharing it at once, crosses the WAN)."""

    @property
    def stages_per_dc(self) -> tuple[int, ...]:
        """Pipeline ranks each used datacenter runs (dc_axis == 'pp'), in ``dcs`` order."""
        return tuple(sum(1 for s in self.stage_sites if s == (j,)) for j in range(len(self.sites)))

    def kind_of_stage(self, rank: int) -> list[DeviceKind]:
        return [self.sites[i].dc.kind for i in self.stage_sites[rank]]


def _span(
    size: int, stride: int, dc: Datacenter, dcs: int = 1, wan: Link | None = None, concurrent: int = 1, streams: int = 1
) -> Span:
    """The span of ``size`` members spaced ``stride`` ranks apart (``dcs`` of them across datacenters)."""
    g = dc.devices_per_node
    per_dc = size // dcs
    per_node = 1 if stride >= g else max(1, min(per_dc, g // stride))
    return Span(per_node, max(1, per_dc // per_node), dcs, dc.intra_node, dc.fabric, wan, concurrent, streams)


def _ring_order(topo: Topology, idx: list[int], closed: bool) -> tuple[list[int], Link | None]:
    """Order datacenters to maximise the slowest link of a ring (closed) or chain; ties: least latency."""
    if len(idx) < 2:
        return idx, None
    best: tuple[float, float] | None = None
    best_order, best_link = idx, None
    for perm in itertools.permutations(idx[1:]):
        order = [idx[0], *perm]
        pairs = list(zip(order, order[1:])) + ([(order[-1], order[0])] if closed and len(order) > 2 else [])
        links = [topo.wan_link(topo.datacenters[a].name, topo.datacenters[b].name) for a, b in pairs]
        worst = min(links, key=lambda l: l.bandwidth)
        score = (-worst.bandwidth, sum(l.latency for l in links))
        if best is None or score < best:
            best, best_order = score, order
            best_link = Link(worst.bandwidth, max(l.latency for l in links), min(l.window for l in links))
    return best_order, best_link


def _compute(dc: Datacenter) -> float:
    return dc.devices * dc.kind.peak("bf16")


def choose_dcs(topo: Topology, layout: LayoutSpec) -> list[int]:
    """The datacenters a layout uses, largest first: the ``layout.datacenters`` with the most peak FLOP/s.

    Ties go to the datacenter nearest (widest, then shortest WAN link) to those already chosen, so a
    far datacenter is the last one added. A layout over all of them keeps the file order, as the
    runtime numbers its ranks; the stage counts (:func:`stage_counts`) still follow the sizes.
    """
    n, k = len(topo.datacenters), layout.datacenters
    if not 1 <= k <= n:
        raise ConfigError("geo.datacenters", k, f"topology {topo.name!r} has {n} datacenter(s)")
    if k == n:
        return list(range(n))
    dcs = topo.datacenters
    chosen = [max(range(n), key=lambda i: _compute(dcs[i]))]
    while len(chosen) < k:

        def reach(i: int) -> tuple[float, float, float]:
            links = [topo.wan_link(dcs[i].name, dcs[j].name) for j in chosen]
            return (_compute(dcs[i]), min(l.bandwidth for l in links), -max(l.latency for l in links))

        chosen.append(max((i for i in range(n) if i not in chosen), key=reach))
    return chosen


def stage_counts(topo: Topology, order: list[int], pp: int, width: int) -> list[int]:
    """Pipeline ranks per datacenter of ``order`` (dc_axis = 'pp'), each rank ``width`` devices.

    At least one each; the rest in proportion to each datacenter's compute (largest remainder, the
    earlier datacenter on ties), never more than its devices hold. Equal datacenters get pp / k
    each, as the runtime places them.
    """
    dcs = [topo.datacenters[i] for i in order]
    hold = [d.devices // width for d in dcs]
    if len(dcs) > pp or min(hold) < 1 or sum(hold) < pp:
        raise ConfigError(
            "parallel.pp",
            pp,
            f"{len(dcs)} datacenter(s) holding {'+'.join(map(str, hold))} stage(s) of {width} devices cannot run it",
        )
    total = sum(_compute(d) for d in dcs)
    ideal = [pp * _compute(d) / total for d in dcs]
    counts = [1] * len(dcs)
    for _ in range(pp - len(dcs)):
        # The datacenter furthest below its share that still has room.
        j = max((i for i in range(len(dcs)) if counts[i] < hold[i]), key=lambda i: (ideal[i] - counts[i], -i))
        counts[j] += 1
    return counts


def runnable(topo: Topology, layout: LayoutSpec, placed: Placement | None = None) -> str | None:
    """Why the runtime cannot run ``layout`` as the planner places it, or None when it can
    (``placed``: its placement, when already made).

    The runtime (``isthmus train`` / ``emulate``) splits the ranks evenly over every datacenter of
    its topology (it runs both WAN schedules); the planner can also use a subset and give
    datacenters unequal stage counts.
    """
    n = len(topo.datacenters)
    why = []
    if 1 < layout.datacenters < n:
        why.append(f"uses {layout.datacenters} of the {n} datacenters")
    if layout.dc_axis == "pp":
        counts = (placed or place(topo, layout)).stages_per_dc
        if len(set(counts)) > 1:
            why.append(f"puts {'+'.join(map(str, counts))} stages in its datacenters")
    return "; ".join(why) or None


def place(topo: Topology, layout: LayoutSpec) -> Placement:
    """Map ``layout`` onto ``topo``; ConfigError when the datacenters cannot hold it."""
    used = choose_dcs(topo, layout)
    per_dc = layout.world // layout.datacenters
    if layout.dc_axis != "pp":  # with stages per datacenter, stage_counts checks what each holds
        for i in used:
            dc = topo.datacenters[i]
            if dc.devices < per_dc:
                raise ConfigError(
                    "plan.layout", layout.label(), f"needs {per_dc} devices in {dc.name!r}, which has {dc.devices}"
                )
    order, ring_link = _ring_order(topo, used, closed=layout.dc_axis == "dp")
    t, c, s = layout.tp, layout.cp, layout.dp_shard
    rep_inner = layout.dp_replicate
    sites = []
    for i in order:
        dc = topo.datacenters[i]
        over = layout.datacenters if layout.dc_axis == "dp" else 1
        # Groups of one shape in one datacenter all cross the WAN at once and share it.
        rep_conc = per_dc // max(1, rep_inner) if over > 1 else 1
        sync_conc = per_dc // max(1, rep_inner * s * c) if over > 1 else 1
        pp_stride = layout.dp * c * t // over
        sites.append(
            SiteSpans(
                dc=dc,
                tp=_span(t, 1, dc),
                cp=_span(c, t, dc),
                shard=_span(s * c, t, dc),
                replicate=_span(layout.replicas, s * c * t, dc, over, ring_link, rep_conc, layout.wan_streams),
                sync=_span(layout.dp * c, t, dc, over, ring_link, sync_conc, layout.wan_streams),
                pp_link=dc.intra_node if pp_stride < dc.devices_per_node else dc.fabric,
                ep=_span(layout.ep, t, dc) if layout.ep > 1 else None,
            )
        )
    pp = layout.pp
    if layout.dc_axis == "pp":
        # Whole stages, all their replicas, per datacenter in chain order, counts by compute.
        counts = stage_counts(topo, order, pp, layout.dp * c * t)
        stage_sites: tuple[tuple[int, ...], ...] = tuple((j,) for j, count in enumerate(counts) for _ in range(count))
    else:
        # Every datacenter runs every stage; alike datacenters cost alike, so keep one of each shape.
        shapes: dict[tuple[object, ...], int] = {}
        for j, site in enumerate(sites):
            d = site.dc
            shapes.setdefault(
                (
                    d.kind,
                    d.devices_per_node,
                    d.intra_node,
                    d.fabric,
                    site.tp,
                    site.cp,
                    site.shard,
                    site.sync.per_node,
                    site.sync.nodes,
                    site.replicate.per_node,
                    site.replicate.nodes,
                    site.ep,
                ),
                j,
            )
        distinct = tuple(sorted(shapes.values()))
        stage_sites = tuple(distinct for _ in range(pp))
    # Each tp rank sends its 1/tp share of an activation (scatter/gather) or the whole of it;
    # either way dp x cp x tp ranks of one stage talk to the next stage at once.
    flows = layout.dp * layout.cp * layout.tp // (layout.datacenters if layout.dc_axis == "dp" else 1)
    links = []
    for r in range(pp - 1):
        a, b = stage_sites[r][0], stage_sites[r + 1][0]
        if layout.dc_axis == "pp" and a != b:
            da, db = topo.datacenters[order[a]], topo.datacenters[order[b]]
            links.append((topo.wan_link(da.name, db.name), flows, True))
        else:
            links.append((sites[a].pp_link, 1, False))
    return Placement(tuple(order), tuple(sites), stage_sites, tuple(links))


class PlacementCache:
    """:func:`place` on one topology, each placement computed once.

    A placement reads only the degrees, the datacenters and the WAN streams of a layout (the key
    below), and a search meets the same ones under many microbatch counts, schedules and
    recomputations: plan_speed's free search placed 13,693 layouts, 1,030 of them distinct."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self._placed: dict[tuple[object, ...], Placement] = {}

    def __call__(self, layout: LayoutSpec) -> Placement:
        key = (
            layout.datacenters,
            layout.dc_axis,
            layout.dp_replicate,
            layout.dp_shard,
            layout.tp,
            layout.cp,
            layout.pp,
            layout.wan_streams,
            layout.ep,
        )
        placed = self._placed.get(key)
        if placed is None:
            placed = self._placed[key] = place(self.topo, layout)
        return placed
