"""Pipeline schedules as arithmetic: step time, bubble, microbatches in flight, stage partition.

For pipeline rank r let S_r be the time of one microbatch through all its layers (forward plus
backward, recomputation included, summed over its v virtual stages) and W_r its weight-gradient
part. With m microbatches the schedules of torch.distributed.pipelining take

    T = m * max(S) + sum_{r != slowest} fill_r / v + sum_links fill_link

where fill_r = S_r (GPipe, 1F1B, interleaved 1F1B) or S_r - 2 W_r (zero bubble: weight gradients
fill the bubble). With even stages this is the textbook (m + (p - 1)/v) S. A link whose sends
overlap compute is a stage of its own in steady state (its occupancy per microbatch competes with
max(S)), and its latency adds once to the fill and drain. With fewer microbatches than ranks the
pipeline never fills, and the step is at least one microbatch's trip through every stage and back.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from isthmus.errors import ConfigError
from isthmus.layout import rules


@dataclass(frozen=True)
class LinkStage:
    """A pipeline boundary whose transfers overlap compute."""

    occupancy: float
    """The shortest period per microbatch the boundary allows: its busy time in the busiest direction
    (all virtual-stage crossings), or its round trip shared by the microbatches in flight around it."""
    fill: float
    """Seconds it adds to fill and drain (one message each way, latency included)."""
    chain: float | None = None
    """Seconds it adds to one microbatch's trip through every stage and back (every crossing of it,
    latency included); None: ``fill``."""


def pipeline_time(
    stage: list[float],
    wgrad: list[float],
    microbatches: int,
    virtual_stages: int,
    schedule: str,
    links: list[LinkStage] | None = None,
) -> tuple[float, float]:
    """(seconds of the forward/backward phase of one step, idle seconds of an average rank)."""
    p, m, v = len(stage), microbatches, max(1, virtual_stages)
    if p == 1:
        return m * stage[0], 0.0
    links = links or []
    # Weight passes fill the bubble under zero bubble; ZB-V (v = 2) has its full set of them to
    # defer only from 2p - 1 microbatches on (torch drops the missing ones from that schedule).
    share = (min(1.0, m / (2 * p - 1)) if v == 2 else 1.0) if schedule == "zero_bubble" else 0.0
    fill = [max(s - 2 * share * w, 0.0) for s, w in zip(stage, wgrad)]
    slowest = max(range(p), key=lambda r: stage[r])
    steady = max([stage[slowest]] + [l.occupancy for l in links])
    total = m * steady + (sum(fill) - fill[slowest]) / v + sum(l.fill for l in links)
    # With fewer microbatches than ranks the pipeline never fills: the step is at least the first
    # microbatch's trip through every stage and back (weight gradients aside under zero bubble),
    # the others one virtual stage behind it each.
    chain = [s - w if schedule == "zero_bubble" else s for s, w in zip(stage, wgrad)]
    trip = sum(chain) + (m - 1) * steady / v + sum(l.fill if l.chain is None else l.chain for l in links)
    total = max(total, trip)
    busy = m * sum(stage) / p
    return total, total - busy


def in_flight(schedule: str, pp: int, virtual_stages: int, microbatches: int, rank: int = 0) -> float:
    """Microbatches whose activations pipeline rank ``rank`` holds at its peak, in units of all its layers.

    1F1B keeps pp - r in flight; interleaved 1F1B warms up 2(pp - r - 1) + (v - 1) pp + 1 virtual-stage
    microbatches, i.e. pp + (pp - 1)/v on rank 0 (Korthikanti et al. 2022, sec. 4.2.3); GPipe all m.
    """
    if pp == 1:
        return 1.0
    v = max(1, virtual_stages)
    if schedule == "gpipe":
        n = float(microbatches)
    elif schedule == "1f1b" or (schedule == "zero_bubble" and v == 2):
        n = float(pp - rank)
    else:
        n = (2 * (pp - rank - 1) + (v - 1) * pp + 1) / v
    return min(float(microbatches), n)


def check_pipeline(
    schedule: str, pp: int, microbatches: int, virtual_stages: int, n_layers: int, megatron_stages: bool
) -> str | None:
    """Why (schedule, pp, microbatches, v) cannot run, or None: the runtime's own rules
    (:mod:`isthmus.layout.rules`), plus Megatron-LM's where the runtime has ``megatron_stages``."""
    why = rules.pipeline_schedule(schedule, pp, microbatches, virtual_stages)
    if why is None and pp > 1:
        why = rules.pipeline_stages(pp, virtual_stages, n_layers)
    if why is not None or pp == 1:
        return why
    if megatron_stages:
        if n_layers % (pp * virtual_stages):
            return "Megatron needs n_layers divisible by pp * virtual stages"
        if schedule == "interleaved_1f1b" and (microbatches % pp or pp == 2):
            return "Megatron's interleaved schedule needs microbatches divisible by pp and pp > 2"
    return None


def partition_layers(n_layers: int, layer_time: list[float], extra: list[float], min_layers: int = 1) -> list[int]:
    """Layers per pipeline rank minimising the slowest rank, for ranks of different speeds.

    Rank r with k layers takes k * layer_time[r] + extra[r] (embedding on the first, head on the
    last). Adding layers one at a time to the rank that stays fastest is optimal for identical
    layers on ranks of different speeds.
    """
    p = len(layer_time)
    if p * min_layers > n_layers:
        raise ConfigError("parallel.pp", p, f"{p} stages x {min_layers} layers is more than n_layers = {n_layers}")
    counts = [min_layers] * p
    heap = [((min_layers + 1) * layer_time[r] + extra[r], r) for r in range(p)]
    heapq.heapify(heap)
    for _ in range(n_layers - p * min_layers):
        _, r = heapq.heappop(heap)
        counts[r] += 1
        heapq.heappush(heap, ((counts[r] + 1) * layer_time[r] + extra[r], r))
    return counts


def even_partition(n_layers: int, pp: int) -> list[int]:
    """Megatron's split: n_layers / pp each (the first ranks take one more when it does not divide)."""
    base, extra = divmod(n_layers, pp)
    return [base + (1 if r < extra else 0) for r in range(pp)]
