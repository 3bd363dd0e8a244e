"""``simulate``: run a layout through the event simulator and report what the planner reports.

The figures (step time, tokens/s, TFLOP/s per device, MFU, memory, bubble, WAN bytes, breakdown,
bottleneck) have the planner's definitions and its JSON keys, so ``isthmus simulate --json`` and
``isthmus plan --json`` compare field by field; ``simulated`` adds the cost model's step time for
the same layout and what the simulation covered.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from statistics import mean

from isthmus.layout.spec import LayoutSpec
from isthmus.models.flops import flops_per_token
from isthmus.planner.compute import BlockShape
from isthmus.planner.cost import (
    Estimate,
    bottleneck_of,
    estimate,
    figures_json,
    ranks_tp_on_host,
    recompute_flops_per_token,
)
from isthmus.planner.memory import USABLE_FRACTION, MemoryBreakdown, device_memory
from isthmus.planner.topology import Topology
from isthmus.planner.workload import Runtime, Workload
from isthmus.sim.engine import Event
from isthmus.sim.program import Simulation


@dataclass
class SimResult:
    layout: LayoutSpec
    work: Workload
    runtime: str
    step_time_s: float
    """Mean over the simulated steps."""
    step_times_s: list[float]
    tokens_per_s: float
    effective_tokens_per_s: float
    tflops_per_device: float
    mfu: float
    mem_per_device_gb: float
    memory: MemoryBreakdown
    fits: bool
    bubble_fraction: float
    wan_bytes_per_step: float
    breakdown: dict[str, float]
    stage_layers: tuple[int, ...]
    planner: Estimate
    """The cost model's estimate of the same layout."""
    devices_simulated: int
    events: int
    wall_s: float
    trace_events: list[Event] = field(default_factory=list)
    track_names: dict[str, str] = field(default_factory=dict)

    @property
    def bottleneck(self) -> str:
        return bottleneck_of(self.breakdown, self.step_time_s)

    def as_json(self) -> dict[str, object]:
        """The planner's JSON fields for this layout, simulated; plus ``simulated`` (what was run)."""
        return {
            **figures_json(self),
            "simulated": {
                "iterations": len(self.step_times_s),
                "step_times_s": self.step_times_s,
                "devices_simulated": self.devices_simulated,
                "devices_represented": self.layout.world,
                "events": self.events,
                "wall_s": self.wall_s,
                "cost_model_step_time_s": self.planner.step_time_s,
                "vs_cost_model": self.step_time_s / self.planner.step_time_s - 1,
            },
        }


def simulate(
    work: Workload, topo: Topology, layout: LayoutSpec, runtime: Runtime, iterations: int = 1, record: bool = False
) -> SimResult:
    """Simulate ``iterations`` optimizer steps of ``layout`` (one data-parallel replica; see program.py).

    ``record`` keeps every interval for a trace or a timeline (memory grows with the op count).
    """
    assert iterations >= 1
    t0 = time.perf_counter()
    sim = Simulation(work, topo, layout, runtime, iterations, record).run()
    wall = time.perf_counter() - t0
    step = mean(sim.iter_time)
    stream_wait = 0.0
    if layout.sync == "streaming_diloco":
        # Each simulated step has a fragment in flight; a real one has one every inner_steps / fragments
        # steps, for 1 / tau of it per step: amortise the wait it caused (geo.streaming_exposed).
        share = min(1.0, max(1, layout.fragments) * max(1, layout.overlap_steps) / max(1, layout.inner_steps))
        waited = mean(max(plan.stats[i].stream_wait for plan in sim.ranks) for i in range(iterations))
        stream_wait = waited * share
        step -= waited - stream_wait
    p = layout.pp
    # Per step, averaged over steps: the pipeline phase ends when the last rank's last op does.
    idle = _pipeline_idle(sim)
    heavy = max(range(p), key=lambda r: sim.ranks[r].stats[0].op_busy)
    slow = max(range(p), key=lambda r: sim.ranks[r].stats[0].end - sim.ranks[r].stats[0].pipe_end)
    dev = sim.devices[heavy]
    per_step = {k: v / iterations for k, v in dev.by_cat.items()}
    s_slow = [plan.stats for plan in sim.ranks][slow]
    tail_wan = mean(s.tail_wan + s.outer for s in s_slow) + stream_wait
    ideal = _without_wan(work, topo, layout, runtime)
    pipe_wan = min(max(0.0, idle), max(0.0, idle - _pipeline_idle(ideal))) if ideal else 0.0
    breakdown = {
        "compute": sum(per_step.get(k, 0.0) for k in ("fwd", "bwd", "wgrad", "recompute")),
        "tp comm": per_step.get("tp", 0.0),
        "cp comm": per_step.get("cp", 0.0),
        "ep comm": per_step.get("ep", 0.0),
        "pp p2p": mean(s.p2p_block for s in sim.ranks[heavy].stats),
        "dp comm": mean(s.tail_wait - s.tail_wan for s in s_slow) + mean(s.gather_wait for s in sim.ranks[heavy].stats),
        "wan": tail_wan + pipe_wan,
        "bubble": max(0.0, idle - pipe_wan),
        "optimizer": mean(s.optimizer for s in s_slow),
    }
    if per_step.get("compression", 0.0) > 0:  # compressed boundaries' encode and decode (geo.pp_compression)
        breakdown["compression"] = per_step["compression"]
    # Each WAN phase carries the bytes of every device it stands for (all replicas included).
    wan_bytes = sum(link.wan_bytes for link in sim.links.values()) / iterations
    est = estimate(work, topo, layout, runtime)
    memory = max((_rank_memory(sim, r) for r in range(p)), key=lambda mb: mb.total)
    kinds = [s.dc.kind for s in sim.placement.sites]
    usable = min(k.memory_bytes for k in kinds) * USABLE_FRACTION
    tokens_per_s = work.tokens_per_step / step
    a = work.args
    model_flops = flops_per_token(a, work.seq_len, False)
    hw_flops = model_flops + recompute_flops_per_token(a, work.seq_len, layout.activation_checkpoint, runtime)
    peak = sum(k.peak(work.dtype) for k in kinds) / len(kinds) * layout.world
    return SimResult(
        layout=layout,
        work=work,
        runtime=runtime.name,
        step_time_s=step,
        step_times_s=list(sim.iter_time),
        tokens_per_s=tokens_per_s,
        effective_tokens_per_s=tokens_per_s * runtime.quality_of(layout.sync),
        tflops_per_device=hw_flops * tokens_per_s / layout.world / 1e12,
        mfu=model_flops * tokens_per_s / peak,
        mem_per_device_gb=memory.total / 1e9,
        memory=memory,
        fits=memory.total <= usable,
        bubble_fraction=breakdown["bubble"] / step if p > 1 else 0.0,
        wan_bytes_per_step=wan_bytes,
        breakdown=breakdown,
        stage_layers=tuple(sim.stage_layers),
        planner=est,
        devices_simulated=p,
        events=sim.engine.processed,
        wall_s=wall,
        trace_events=sim.engine.events,
        track_names=_track_names(sim),
    )


def _pipeline_idle(sim: Simulation) -> float:
    """Seconds an average pipeline rank idles per step until the last rank's last op ends."""
    stats = [[plan.stats[i] for plan in sim.ranks] for i in range(sim.iterations)]
    return mean(mean(max(s.pipe_end for s in row) - s.op_busy - s.p2p_block for s in row) for row in stats)


def _without_wan(work: Workload, topo: Topology, layout: LayoutSpec, runtime: Runtime) -> Simulation | None:
    """The same replica with instant WAN links, when pipeline stages cross datacenters: what the
    pipeline idles beyond it is WAN time (latency and bytes), as the cost model's wan counts it."""
    if layout.pp == 1 or layout.dc_axis != "pp" or layout.datacenters < 2:
        return None
    ideal = replace(topo, wan={k: replace(link, bandwidth=1e18, latency=0.0) for k, link in topo.wan.items()})
    return Simulation(work, ideal, layout, runtime).run()


def _rank_memory(sim: Simulation, r: int) -> MemoryBreakdown:
    """Peak memory of rank r with the activations its simulated schedule actually keeps in flight."""
    lay, work, plan = sim.layout, sim.work, sim.ranks[r]
    layers = sum(o.layers for o in plan.stages.values())
    first = any(o.first for o in plan.stages.values())
    last = any(o.last for o in plan.stages.values())
    return device_memory(
        BlockShape.of(work, lay),
        sim.runtime,
        layers=layers,
        first=first,
        last=last,
        pp=lay.pp,
        activation_checkpoint=lay.activation_checkpoint,
        in_flight=min(float(lay.microbatches), sim.peak_in_flight(r)) if lay.pp > 1 else 1.0,
        zero_stage=lay.zero_stage,
        shard=lay.shard_degree,
        accumulate=lay.microbatches_per_step > 1,
        microbatches=lay.microbatches,
        # Each simulated stage module wraps blocks 0, 2, ... of its own, as the runtime does.
        modules=[o.layers for o in plan.stages.values()],
        fsdp=lay.data_parallel_kind == "fsdp",
        tp_shared_file=ranks_tp_on_host(sim.placement, sim.runtime, r),
    )


def _track_names(sim: Simulation) -> dict[str, str]:
    lay = sim.layout
    group = lay.tp * lay.cp
    names = {}
    for plan in sim.ranks:
        who = (
            f"{group} devices (tp{lay.tp}" + (f" x cp{lay.cp}" if lay.cp > 1 else "") + ")" if group > 1 else "1 device"
        )
        stages = ",".join(str(s) for s in sorted(plan.stages))
        names[f"device:{plan.rank}"] = (
            f"pp rank {plan.rank} (stage{'s' if len(plan.stages) > 1 else ''} {stages}; {who}, {plan.site.dc.name})"
        )
    for name, link in sim.links.items():
        names["link:" + name] = ("WAN " + name[4:]) if link.kind == "wan" else f"link {name}"
    return names
