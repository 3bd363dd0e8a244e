"""Data-parallel synchronisation per step, inside a datacenter and across datacenters.

Inside a datacenter: DDP all-reduces gradients over dp x cp; ZeRO/FSDP reduce-scatters them over
the shard group (dp_shard x cp), all-reduces the shard over dp_replicate (HSDP), and gathers
weights back. When data-parallel replicas span datacenters (``dc_axis = 'dp'``) the gradient
crosses the WAN by one of four strategies:

- ``flat``: one ring through every replica, WAN hops included (each ring step waits for the WAN);
- ``hierarchical``: reduce inside each datacenter first, all-reduce only the shards across the WAN
  (every device sends its 1/k share; all of a datacenter's devices share its WAN link);
- ``compressed``: hierarchical, the WAN phase carries ``runtime.compress_ratio`` of the bytes
  (e.g. 4-bit quantised gradients with error feedback);
- ``diloco``: each datacenter steps on its own; every H steps the fp32 parameter deltas are
  all-reduced across the WAN (Douillard et al. 2023), so the WAN cost per step is 1/H of that.
- ``streaming_diloco`` (Douillard et al. 2025, as `isthmus.geo.diloco` runs it): F fragments of the
  model in turn, one every H / F steps, their int4 outer gradients all-gathered across datacenters
  while the next ``overlap_steps`` (tau) inner steps compute. The transfer blocks only where it
  outlasts them: a step costs max(0, t_fragment - tau * t_step) * F / H on top
  (`streaming_exposed`); the WAN bytes per step are the int4 model's exchange over H.

When stage boundaries cross the WAN (``dc_axis = 'pp'``), the k data-parallel pipelines of a stage
(k = dp x cp x tp senders) each send a message of S bytes over the same link of bandwidth B at
each boundary (`pipeline_transfer`). ``geo.wan_schedule = 'fair'``: all k at once, each at B/k, so
every message takes k S/B and the pipelines stall together. ``'time_shared'`` (Atlas): the link
serves them in turn, each in a slot of S/B with the whole link, pipeline i starting its
microbatches i slots after the first; the link is as busy (k S/B per message round), but each
message arrives after S/B, and the step ends (k - 1) S/B later than one pipeline's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from isthmus.layout.spec import LayoutSpec
from isthmus.planner import comm
from isthmus.planner.comm import Span
from isthmus.planner.compression import outer_equivalent
from isthmus.planner.placement import SiteSpans
from isthmus.planner.topology import Link
from isthmus.planner.workload import Runtime

INITIAL_WINDOW_BYTES = 10 * 1448
"""A new or long-idle TCP flow's first window: 10 segments (RFC 6928, Linux's default)."""


@dataclass(frozen=True)
class PipelineTransfer:
    """One message round at a pipeline boundary: every pipeline's message of one microbatch."""

    seconds: float
    """What one message takes as its receiver sees it, latency included."""
    occupancy: float
    """Seconds the link is busy carrying every pipeline's message (the same for both schedules)."""
    stagger: float
    """time_shared: seconds the last pipeline starts after the first (once per step)."""


def tcp_seconds(nbytes: float, link: Link, flows: int) -> float:
    """Seconds ``flows`` TCP connections, starting together, take to put ``nbytes`` (split evenly)
    through ``link``, not counting the last byte's latency. A link without a TCP window is the
    alpha-beta link (bytes / bandwidth). With one (`Link.window`), each flow carries at most its
    window per round trip, and a flow left idle longer than its retransmission timeout (a pipeline's
    flow between two microbatches) restarts from the initial window, doubling it every round trip
    (slow start, Linux's default ``tcp_slow_start_after_idle``): a short message spends most of its
    time there."""
    rate = link.rate(flows)
    if math.isinf(link.window) or link.latency <= 0:
        return nbytes / rate
    rtt = 2 * link.latency
    per_flow, cap = nbytes / flows, rate * rtt / flows  # bytes per round trip once ramped up
    sent, cwnd, seconds = 0.0, float(INITIAL_WINDOW_BYTES), 0.0
    while cwnd < cap and sent + cwnd < per_flow:
        sent, cwnd, seconds = sent + cwnd, 2 * cwnd, seconds + rtt
    return seconds + (per_flow - sent) * rtt / cap


def pipeline_transfer(
    nbytes: float, link: Link, pipelines: int, schedule: str, streams: int = 1, early_recv: bool = False
) -> PipelineTransfer:
    """``pipelines`` messages of ``nbytes`` crossing ``link`` together, fairly shared or in time
    slots, each split over ``streams`` TCP connections (``geo.wan_streams``), timed by
    `tcp_seconds`: shared, every pipeline's connections run at once; in slots, one pipeline's.

    On a link with a TCP window (the flows modelled as TCP runs them) the runtime's handshake
    counts too: gloo writes a message only once its receiver has posted the receive, and the
    receiver posts it when it needs the data (a time-shared one: when it takes its turn), so the
    sender learns of it one latency later: a round trip per message on top of its bytes, unless the
    receives were posted ahead (``early_recv``, ``geo.pp_early_recv``; fair sharing only). Links
    without a window keep the alpha-beta figures (one latency per message)."""
    if nbytes <= 0:
        return PipelineTransfer(0.0, 0.0, 0.0)
    posted_ahead = early_recv and schedule == "fair"
    handshake = link.latency if not math.isinf(link.window) and not posted_ahead else 0.0
    if schedule == "time_shared":
        busy = tcp_seconds(nbytes, link, streams)
        # The next turn's bytes arrive a handshake and a latency after this one's last byte.
        period = busy + 2 * handshake
        return PipelineTransfer(handshake + link.latency + busy, pipelines * period, (pipelines - 1) * period)
    busy = tcp_seconds(pipelines * nbytes, link, pipelines * streams)
    return PipelineTransfer(handshake + link.latency + busy, busy, 0.0)


@dataclass(frozen=True)
class SyncCost:
    """Data-parallel communication of one device per step (seconds), split by what it can overlap."""

    grad: float
    """Gradient reduction at the end of backward (overlaps the last microbatch's backward)."""
    params: float
    """Weight gathers (ZeRO/FSDP) not tied to one microbatch (overlap the first forward)."""
    per_microbatch: float
    """ZeRO-3 gathers repeated for every microbatch (overlap that microbatch's compute)."""
    wan: float
    """Of ``grad``, the seconds on WAN links (amortised over H steps for DiLoCo)."""
    wan_bytes: float
    """Bytes all groups of this pipeline rank send across datacenters per step."""
    fragment: float = 0.0
    """streaming_diloco: WAN seconds of one fragment's outer-gradient exchange (overlapped)."""


def _inside(span: Span) -> Span:
    return Span(span.per_node, span.nodes, 1, span.intra, span.fabric)


def _wan_phase(nbytes: float, span: Span) -> float:
    """The cross-datacenter all-reduce of a hierarchical all-reduce on ``span`` (both halves)."""
    if span.dcs <= 1:
        return 0.0
    k, bw, lat = span.tiers()[-1]
    chunk = nbytes / (span.per_node * span.nodes)
    return 2 * ((k - 1) * lat + (k - 1) / k * chunk / bw)


def cross_dc_all_reduce(nbytes: float, span: Span, layout: LayoutSpec, runtime: Runtime) -> tuple[float, float, float]:
    """(seconds, of which WAN, WAN bytes of this group) of an all-reduce whose group may span datacenters."""
    if span.dcs <= 1:
        return comm.all_reduce(nbytes, span), 0.0, 0.0
    inside = comm.all_reduce(nbytes, _inside(span))
    if layout.sync == "flat":
        total = comm.all_reduce(nbytes, span, "ring")
        return total, max(0.0, total - inside), comm.wan_bytes_all_reduce(nbytes, span, "ring")
    if layout.sync == "diloco":
        delta = outer_equivalent(nbytes, span.dcs, layout, runtime)
        h = max(1, layout.inner_steps)
        wan = _wan_phase(delta, span) / h
        return inside + wan, wan, comm.wan_bytes_all_reduce(delta, span) / h
    if layout.sync == "streaming_diloco":  # nothing blocking every step: see streaming_fragment
        return (
            inside,
            0.0,
            comm.wan_bytes_all_reduce(streaming_equivalent(nbytes, span, layout, runtime), span)
            / max(1, layout.inner_steps),
        )
    ratio = runtime.compress_ratio if layout.sync == "compressed" else 1.0
    wan = _wan_phase(nbytes * ratio, span)
    return inside + wan, wan, comm.wan_bytes_all_reduce(nbytes * ratio, span)


def streaming_equivalent(nbytes: float, span: Span, layout: LayoutSpec, runtime: Runtime) -> float:
    """The all-reduce size whose WAN phase moves what Streaming DiLoCo's exchange moves.

    Each of k datacenters all-gathers its payload P (int4 outer gradients of ``nbytes`` worth of
    fp32 gradients by default; ``geo.outer_dtype``: :func:`~isthmus.planner.compression.outer_equivalent`):
    (k - 1) P leave each datacenter, as in the WAN phase of an all-reduce of k P / 2.
    """
    return outer_equivalent(nbytes, span.dcs, layout, runtime)


def streaming_fragment(nbytes: float, span: Span, layout: LayoutSpec, runtime: Runtime) -> float:
    """WAN seconds of one fragment's exchange (1 / fragments of the parameters); 0 for other strategies."""
    if layout.sync != "streaming_diloco":
        return 0.0
    return _wan_phase(streaming_equivalent(nbytes, span, layout, runtime) / max(1, layout.fragments), span)


def streaming_exposed(fragment_s: float, step_s: float, layout: LayoutSpec) -> float:
    """Seconds per step Streaming DiLoCo adds: a fragment's transfer runs behind ``overlap_steps``
    inner steps and blocks for the rest; one fragment syncs every inner_steps / fragments steps."""
    h = max(1, layout.inner_steps)
    return max(0.0, fragment_s - layout.overlap_steps * step_s) * max(1, layout.fragments) / h


def dp_sync(params: float, site: SiteSpans, layout: LayoutSpec, runtime: Runtime) -> SyncCost:
    """Communication for one device holding ``params`` parameters (after tp and pp) per step."""
    grads = params * runtime.grad_bytes
    weights = params * runtime.weight_bytes
    shard = layout.shard_degree
    if layout.grad_sync_degree <= 1:
        return SyncCost(0.0, 0.0, 0.0, 0.0, 0.0)
    ranks = layout.tp * layout.dp * layout.cp  # devices of one pipeline rank, all datacenters
    if shard <= 1:
        t, wan, wan_bytes = cross_dc_all_reduce(grads, site.sync, layout, runtime)
        frag = streaming_fragment(grads, site.sync, layout, runtime)
        return SyncCost(t, 0.0, 0.0, wan, wan_bytes * ranks / site.sync.size, frag)
    rs = comm.reduce_scatter(grads, site.shard)
    t, wan, wan_bytes = cross_dc_all_reduce(grads / shard, site.replicate, layout, runtime)
    wan_bytes *= ranks / site.replicate.size
    frag = streaming_fragment(grads / shard, site.replicate, layout, runtime)
    gather = comm.all_gather(weights, site.shard)
    if layout.zero_stage == 1:
        # ZeRO-1 (Megatron's distributed optimizer, with or without tp/pp): each shard's gradients
        # reduced to the rank that owns its optimizer state, the updated weights gathered back once
        # per step, the bytes of one all-reduce; the weights stay whole, so no microbatch gathers.
        return SyncCost(rs + t, gather, 0.0, wan, wan_bytes, frag)
    if layout.zero_stage == 3 and layout.pp == 1:
        return SyncCost(rs + t, 0.0, 2 * gather, wan, wan_bytes, frag)
    if layout.zero_stage == 3:
        again = 0.0 if runtime.gathered_across_microbatches else gather
        return SyncCost(rs + t, gather, again, wan, wan_bytes, frag)
    # ZeRO-2: weights gathered once per microbatch (pp == 1, resharded after backward) or per step.
    return SyncCost(rs + t, gather if layout.pp > 1 else 0.0, gather if layout.pp == 1 else 0.0, wan, wan_bytes, frag)
