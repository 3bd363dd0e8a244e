"""Wire one data-parallel replica of a layout into the engine: devices, links, programs.

Symmetry keeps it small. Data-parallel replicas run identical programs on identical links, so one
replica is simulated and its data-parallel collectives are timed on the links the planner puts
them on (with the other replicas' share of a WAN link taken out). Inside the replica the tensor-
and context-parallel peers of a pipeline stage are symmetric too: one simulated *device* stands for
the ``tp x cp`` devices of each pipeline rank, and its tensor-parallel collectives run inside its
ops on the group's own NVLink share (blocking, as the planner assumes, uncontended); pipeline
sends and data-parallel traffic go over that device's ports and WAN links, where they share
bandwidth with whatever else is in flight. With ``geo.wan_schedule = 'time_shared'`` a WAN link at
a stage boundary is a :class:`~isthmus.sim.engine.SlotLink`: the simulated pipeline's message takes
the whole link for one slot and reserves it for the other pipelines' slots; those pipelines run
the same program one slot apart each, so a step ends (pipelines - 1) slots after the simulated
one's (the stagger, as in ``planner.geo.pipeline_transfer``).

Per device, per step: the pipeline schedule's actions in torch's order (schedule.py), each a
forward, backward, input-gradient or weight-gradient pass of one microbatch through one stage
(costs.py); receives block, sends do not (isthmus) or do (Megatron 2021); weight gathers of
ZeRO/FSDP overlap the op that needs them; a gradient bucket (one per block, plus the embedding and
the head) starts its reduction when the last microbatch's backward has produced it, queued behind
the device's earlier buckets; the optimizer runs when all buckets are reduced; steps are separated
by a barrier (the gradient-norm all-reduce makes one), free: the loss sum runs behind the next
step, and under DiLoCo once per outer round (docs/cost-model.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from isthmus.layout.spec import LayoutSpec
from isthmus.planner.compression import boundary_message, codec_seconds
from isthmus.planner.compute import BlockShape, ends_times, optimizer_time, shard_overhead
from isthmus.planner.cost import block_cost, recomputed, stage_costs
from isthmus.planner.geo import dp_sync, pipeline_transfer
from isthmus.planner.pipeline import partition_layers
from isthmus.planner.placement import Placement, SiteSpans, place
from isthmus.planner.topology import DeviceKind, Topology
from isthmus.planner.workload import Runtime, Workload
from isthmus.sim import costs
from isthmus.sim.costs import DpPlan, PhaseSpec, StageOps
from isthmus.sim.engine import Device, Engine, Link, Phase, SlotLink, Stream, Token, Transfer
from isthmus.sim.schedule import Action, peak_in_flight, rank_actions, stage_ranks


@dataclass
class RankStats:
    """What one simulated device did in one step (seconds from the step's start unless noted)."""

    pipe_end: float = 0.0
    """End of its last forward/backward/weight op."""
    op_busy: float = 0.0
    """Seconds inside ops, plus waits on the weights an op needed."""
    gather_wait: float = 0.0
    tail_wait: float = 0.0
    """Waiting for gradient reductions after its last op."""
    tail_wan: float = 0.0
    """Of tail_wait, the part with a WAN phase of its own in flight."""
    p2p_block: float = 0.0
    """Blocking sends and tp gathers of received activations (Megatron's p2p)."""
    optimizer: float = 0.0
    outer: float = 0.0
    """DiLoCo's amortised blocking outer sync."""
    stream_wait: float = 0.0
    """Streaming DiLoCo: waiting, after the optimizer, for the fragment in flight (not amortised)."""
    end: float = 0.0


@dataclass
class RankPlan:
    rank: int
    site: SiteSpans
    kind: DeviceKind
    stages: dict[int, StageOps]
    actions: list[Action]
    params: float
    dp: DpPlan
    wan_bytes: float
    """Bytes all data-parallel groups of this pipeline rank send across datacenters per step."""
    stats: list[RankStats] = field(default_factory=list)


class Simulation:
    """One replica of ``layout`` on ``topo``, built and run for ``iterations`` steps."""

    def __init__(
        self,
        work: Workload,
        topo: Topology,
        layout: LayoutSpec,
        runtime: Runtime,
        iterations: int = 1,
        record: bool = False,
    ) -> None:
        self.work, self.topo, self.layout, self.runtime = work, topo, layout, runtime
        self.iterations = iterations
        self.engine = Engine(record)
        self.placement: Placement = place(topo, layout)
        self.stage_layers = [s.layers for s in stage_costs(work, layout, runtime, self.placement)]
        p, v = layout.pp, layout.pp_virtual_stages
        self.n_stages = p * v if p > 1 else 1
        self.stage_rank = stage_ranks(layout.pp_schedule, p, v) if p > 1 else [0]
        self.stage_blocks = self._stage_blocks()
        self.ranks = [self._plan_rank(r) for r in range(p)]
        self.stage_layers = [sum(o.layers for o in plan.stages.values()) for plan in self.ranks]
        self.links: dict[str, Link] = {}
        self.act: dict[tuple[int, int, int], Token] = {}
        """(step, stage, microbatch) -> the stage's input activation has arrived."""
        self.grad: dict[tuple[int, int, int], Token] = {}
        """(step, stage, microbatch) -> the gradient of the stage's output has arrived."""
        self._deferred: dict[int, list[Transfer]] = {}
        self._routes: dict[tuple[int, int], Phase] = {}
        first, self.first_layer = 0, []
        for s in range(self.n_stages):
            self.first_layer.append(first)
            first += self.ranks[self.stage_rank[s]].stages[s].layers
        self.msg = costs.p2p_message(work, layout, runtime)
        self.wan_msg = boundary_message(work, layout, runtime, wan=True)
        """Bytes of one message across datacenters: ``msg``, or its compressed form (geo.pp_compression)."""
        self.codec = [codec_seconds(plan.kind, work, layout, runtime) for plan in self.ranks]
        """Per rank, seconds of its half of one compressed message's encode and decode (0: exact)."""
        self.stagger = max(
            [
                pipeline_transfer(self.wan_msg, link, share, layout.wan_schedule, layout.wan_streams).stagger
                for link, share, wan in self.placement.boundary_links
                if wan
            ]
            + [0.0]
        )
        """Seconds the last data-parallel pipeline ends after the simulated one (time-shared WAN slots)."""
        self.iter_start = [Token() for _ in range(iterations + 1)]
        self.iter_time: list[float] = []
        self.streams = {(r, "gather"): Stream() for r in range(p)}
        host, weight = None, 0.0
        if topo.host_cores is not None:
            # Every simulated device stands for the tp x cp x dp devices of its pipeline rank, all
            # one-thread processes on the same cores (Device's docstring).
            host = Link(self.engine, "host cores", "cpu")
            weight = layout.tp * layout.cp * layout.dp / topo.host_cores
        self.devices = [Device(self.engine, r, self._program(r), host, weight) for r in range(p)]
        self._left = p

    # --- building --------------------------------------------------------------------------------
    def _stage_blocks(self) -> list[int]:
        """Blocks per stage: the planner's per-rank split with one stage per rank; with several, the
        runtime's rule: stages balanced by cost, the embedding on the first and the head on the last
        (which ZB-V puts on rank 0)."""
        lay, work = self.layout, self.work
        if self.n_stages == lay.pp:
            return list(self.stage_layers)
        per_rank = []
        for r in range(lay.pp):
            site = self.placement.sites[self.placement.stage_sites[r][0]]
            bc = block_cost(site.dc.kind, site, BlockShape.of(work, lay), lay.cp_impl, self.runtime)
            per_rank.append(bc.fwd + bc.bwd + sum(recomputed(bc, lay.activation_checkpoint, self.runtime)))
        site = self.placement.sites[0]
        emb, head = ends_times(site.dc.kind, BlockShape.of(work, lay), self.runtime.fused_cross_entropy)
        extra = [0.0] * self.n_stages
        extra[0] += emb.fwd + emb.backward
        extra[-1] += head.fwd + head.backward
        return partition_layers(work.args.n_layers, [per_rank[r] for r in self.stage_rank], extra)

    def _plan_rank(self, r: int) -> RankPlan:
        lay, work = self.layout, self.work
        mine = [s for s in range(self.n_stages) if self.stage_rank[s] == r]
        counts = {s: self.stage_blocks[s] for s in mine}
        best: RankPlan | None = None
        for i in self.placement.stage_sites[r]:  # datacenters that run this rank: keep the slowest
            site = self.placement.sites[i]
            kind = site.dc.kind
            ops = {
                s: costs.stage_ops(kind, site, work, lay, self.runtime, s, counts[s], s == 0, s == self.n_stages - 1)
                for s in mine
            }
            total = sum(o.fwd.seconds + o.full_bwd.seconds for o in ops.values())
            params = sum(o.params for o in ops.values())
            plan = RankPlan(
                r,
                site,
                kind,
                ops,
                rank_actions(lay.pp_schedule, lay.pp, lay.pp_virtual_stages, lay.microbatches_per_step, r),
                params,
                costs.dp_plan(site, lay, self.runtime),
                dp_sync(params, site, lay, self.runtime).wan_bytes,
            )
            if best is None or total > sum(o.fwd.seconds + o.full_bwd.seconds for o in best.stages.values()):
                best = plan
        assert best is not None
        return best

    def _link(self, name: str, kind: str, slotted: bool = False) -> Link:
        link = self.links.get(name)
        if link is None:
            link = self.links[name] = (SlotLink if slotted else Link)(self.engine, name, kind)
        return link

    def _phases(self, r: int, specs: list[PhaseSpec], wan_bytes: float = 0.0) -> list[Phase]:
        """Phases of rank r's data-parallel collective on its ports and the WAN."""
        site, out = self.ranks[r].site, []
        for ph in specs:
            if ph.tier == "wan":
                # Every pipeline rank's groups share the WAN link at nominal speed (the planner's
                # view); one alone goes up to pp times faster, but never faster than its NIC.
                floor = ph.bandwidth / max(site.dc.fabric.bandwidth, site.dc.intra_node.bandwidth)
                wan = self._link("wan dp", "wan")
                out.append(Phase(wan, ph.latency, ph.seconds, 1.0 / self.layout.pp, floor, wan_bytes))
            else:
                out.append(Phase(self._link(f"stage{r}.{ph.tier}", ph.tier), ph.latency, ph.seconds))
        return out

    def _send(self, it: int, r: int, src: int, dst: int, mb: int, forward: bool) -> Transfer | None:
        """The transfer carrying stage src's output (or input gradient) to stage dst; None if local."""
        peer = self.stage_rank[dst]
        table = self.act if forward else self.grad
        token = table.setdefault((it, dst, mb), Token())
        if peer == r:
            return None
        phase = self._routes.get((r, peer))
        if phase is None:
            link, share, crosses = self._boundary(r, peer)
            slotted = crosses and self.layout.wan_schedule == "time_shared"
            if crosses:
                a, b = (self.ranks[r].site.dc.name, self.ranks[peer].site.dc.name)
                res = self._link(f"wan {a}->{b}", "wan", slotted)
            else:
                tier = "intra" if link == self.ranks[r].site.dc.intra_node else "fabric"
                res = self._link(f"stage{r}.{tier}", tier)
            schedule = "time_shared" if slotted else "fair"
            msg = self.wan_msg if crosses else self.msg
            streams = self.layout.wan_streams if crosses else 1
            timing = pipeline_transfer(msg, link, share, schedule, streams, crosses and self.layout.pp_early_recv)
            seconds = timing.seconds - link.latency
            # A message stands for all dp x cp x tp devices' messages on a WAN boundary (share):
            # shared, it takes them all at once; in slots, its own and then the others' turns.
            wan_bytes = msg * share if crosses else 0.0
            hold = timing.occupancy - seconds if slotted else 0.0
            phase = self._routes[(r, peer)] = Phase(res, link.latency, seconds, 1.0, 0.0, wan_bytes, hold)
        name = f"{'act' if forward else 'grad'} mb{mb} s{src}->s{dst}" if self.engine.record else ""
        xfer = Transfer(self.engine, [phase], name, "p2p", f"device:{r}", "p2p")
        xfer.token = token
        return xfer

    def _boundary(self, a: int, b: int) -> tuple[Any, int, bool]:
        """The link between pipeline ranks a and b (neighbours, or the last and the first)."""
        pl = self.placement
        lo, hi = min(a, b), max(a, b)
        if hi - lo == 1:
            return pl.boundary_links[lo]
        sa, sb = pl.stage_sites[a][0], pl.stage_sites[b][0]
        if sa != sb and self.layout.dc_axis == "pp":
            da, db = pl.sites[sa].dc, pl.sites[sb].dc
            flows = self.layout.dp * self.layout.cp * self.layout.tp
            return self.topo.wan_link(da.name, db.name), flows, True
        return pl.sites[sa].pp_link, 1, False

    def _transfer(
        self, r: int, specs: list[PhaseSpec], params: float, name: str, stream: str | None, wan_bytes: float = 0.0
    ) -> Transfer:
        phases = self._phases(r, costs.scale(specs, params), wan_bytes)
        return Transfer(
            self.engine, phases, name, "dp", f"device:{r}", "dp", self.streams[(r, stream)] if stream else None
        )

    # --- one device's program ----------------------------------------------------------------------
    def _program(self, r: int) -> Iterator[tuple[Any, ...]]:
        eng, lay, plan = self.engine, self.layout, self.ranks[r]
        m, blocking = lay.microbatches_per_step, not self.runtime.p2p_async
        gather_tp = costs.tp_gather(self.work, lay, plan.site) if blocking and self.runtime.scatter_gather else 0.0
        dp = plan.dp
        labels = {s: f"L{self.first_layer[s]}-{self.first_layer[s] + o.layers - 1}" for s, o in plan.stages.items()}
        for it in range(self.iterations):
            yield ("wait", self.iter_start[it])
            t0 = eng.now
            st = RankStats()
            # Streaming DiLoCo: the fragment launched after the previous step crosses the WAN behind this one.
            stream = None
            if dp.stream:
                stream = self._transfer(r, dp.stream, plan.params, "streaming fragment", None, plan.wan_bytes)
                stream.start()
            # Weights gathered once per step (ZeRO-1's broadcast, ZeRO-2/3 under pp), stage by stage.
            step_gathers = {}
            for s, ops in plan.stages.items():
                if dp.step_gather:
                    xf = self._transfer(r, dp.step_gather, ops.params, f"gather s{s}", "gather")
                    xf.start()
                    step_gathers[s] = xf.token
            buckets: list[Token] = []
            bwd_gathers: dict[tuple[int, int], Token] = {}
            wan_log: list[tuple[float, float]] = []
            for kind, s, mb in plan.actions:
                ops = plan.stages[s]
                name = f"{kind} mb{mb} {labels[s]}" if eng.record else kind
                if kind == "F":
                    if s > 0:
                        yield ("wait", self.act.setdefault((it, s, mb), Token()))
                        yield from self._receive(r, self.stage_rank[s - 1], mb, gather_tp, st)
                    op = ops.fwd
                    need = []
                    if dp.mb_gather:
                        xf = self._transfer(r, dp.mb_gather, ops.params, f"gather {name}", "gather")
                        xf.start()
                        need.append(xf.token)
                    if dp.bwd_gather:  # FSDP prefetches the backward's gather behind this one
                        xf = self._transfer(r, dp.mb_gather, ops.params, f"gather B mb{mb} {labels[s]}", "gather")
                        xf.start()
                        bwd_gathers[(s, mb)] = xf.token
                    if mb == 0 and s in step_gathers:
                        need.append(step_gathers[s])
                    t_op = eng.now
                    yield from self._run_op(op, name, "fwd", need)
                    st.gather_wait += eng.now - t_op - op.seconds
                    st.op_busy += eng.now - t_op
                    if s < self.n_stages - 1:
                        yield from self._emit(it, r, s, s + 1, mb, True, blocking, st)
                    continue
                if kind in ("B", "I"):
                    if s < self.n_stages - 1:
                        yield ("wait", self.grad.setdefault((it, s, mb), Token()))
                        yield from self._receive(r, self.stage_rank[s + 1], mb, gather_tp, st)
                    op = ops.full_bwd if kind == "B" else ops.input_bwd
                else:
                    op = ops.weight_bwd
                need = []
                if dp.bwd_gather and kind != "W":
                    need.append(bwd_gathers.pop((s, mb)))
                if mb == m - 1 and kind in ("B", "W") and dp.grad:
                    for off, params in op.bucket_ends:
                        share = plan.wan_bytes * params / plan.params if plan.params else 0.0
                        label = f"grad s{s} +{off * 1e3:.1f}ms" if eng.record else ""
                        xf = self._transfer(r, dp.grad, params, label, None, share)
                        xf.wan_log = wan_log
                        buckets.append(xf.token)
                        if self.runtime.dp_overlap:
                            yield ("start_at", off, xf)
                        else:
                            self._deferred.setdefault(r, []).append(xf)
                t_op = eng.now
                yield from self._run_op(op, name, "bwd" if kind != "W" else "wgrad", need)
                st.gather_wait += eng.now - t_op - op.seconds
                st.op_busy += eng.now - t_op
                if kind in ("B", "I") and s > 0:
                    yield from self._emit(it, r, s, s - 1, mb, False, blocking, st)
            st.pipe_end = eng.now - t0
            # Megatron 2021 starts the gradient all-reduce after the pipeline flush.
            for xf in self._deferred.pop(r, []):
                xf.start()
            t_wait = eng.now
            for tok in buckets:
                yield ("wait", tok)
            st.tail_wait = eng.now - t_wait
            st.tail_wan = min(st.tail_wait, sum(max(0.0, e - max(s0, t_wait)) for s0, e in wan_log))
            st.optimizer = optimizer_time(plan.kind, plan.params / max(1, lay.shard_degree))
            # FSDP2's measured per-block work, where the cost model puts it too: with the optimizer.
            st.optimizer += shard_overhead(plan.kind, lay, sum(o.layers for o in plan.stages.values()))
            yield ("compute", st.optimizer, "optimizer", "optimizer", None)
            if dp.outer:
                t_outer = eng.now
                xf = self._transfer(r, dp.outer, plan.params, "diloco outer sync", None, plan.wan_bytes)
                yield ("start", xf)
                yield ("wait", xf.token)
                st.outer = eng.now - t_outer
            if stream is not None:
                t_stream = eng.now
                yield ("wait", stream.token)
                st.stream_wait = eng.now - t_stream
            st.end = eng.now - t0
            plan.stats.append(st)
            self._rank_done(it)

    def _run_op(self, op: costs.Op, name: str, cat: str, need: list[Token]) -> Iterator[tuple[Any, ...]]:
        """The op, and the weights it needs: gathered behind it (overlap), or before it."""
        if not self.runtime.gathers_overlap:
            for tok in need:
                yield ("wait", tok)
        yield ("compute", op.seconds, name, cat, op.detail)
        for tok in need:
            yield ("wait", tok)

    def _emit(
        self, it: int, r: int, src: int, dst: int, mb: int, forward: bool, blocking: bool, st: RankStats
    ) -> Iterator[tuple[Any, ...]]:
        xf = self._send(it, r, src, dst, mb, forward)
        table = self.act if forward else self.grad
        if xf is None:
            tok = table[(it, dst, mb)]
            tok.done, tok.time = True, self.engine.now
            return
        yield from self._codec(r, self.stage_rank[dst], f"encode mb{mb}", st)
        yield ("start", xf)
        if blocking:
            t = self.engine.now
            yield ("wait", xf.token)
            st.p2p_block += self.engine.now - t

    def _receive(self, r: int, peer: int, mb: int, gather_tp: float, st: RankStats) -> Iterator[tuple[Any, ...]]:
        """After a message from ``peer`` arrived: a rendezvous receive holds this rank for the transfer
        too (DeepSpeed's blocking p2p.recv), then scatter/gather's all-gather over tp."""
        if peer == r:
            return
        yield from self._codec(r, peer, f"decode mb{mb}", st)
        hold = 0.0
        if self.runtime.p2p_rendezvous and not self.runtime.p2p_async:
            phase = self._routes[(peer, r)]
            hold = phase.latency + phase.seconds
        if hold + gather_tp > 0:
            st.p2p_block += hold + gather_tp
            yield ("compute", hold + gather_tp, f"recv mb{mb}", "p2p", None)

    def _codec(self, r: int, peer: int, name: str, st: RankStats) -> Iterator[tuple[Any, ...]]:
        """Rank r's half of a compressed message's encode and decode, on a boundary between datacenters."""
        if self.codec[r] > 0 and self._boundary(r, peer)[2]:
            st.op_busy += self.codec[r]
            yield ("compute", self.codec[r], name if self.engine.record else "codec", "compression", None)

    def _rank_done(self, it: int) -> None:
        self._left -= 1
        if self._left == 0:
            self._left = len(self.devices)
            # The barrier waits for the last pipeline, a stagger behind the simulated one.
            end = self.engine.now + self.stagger
            self.iter_time.append(end - (self.iter_start[it].time if it else 0.0))
            if self.stagger > 0:
                self.engine.at(end, self.engine.fire, self.iter_start[it + 1])
            else:
                self.engine.fire(self.iter_start[it + 1])

    # --- running ---------------------------------------------------------------------------------
    def run(self) -> Simulation:
        self.engine.fire(self.iter_start[0])
        for d in self.devices:
            d.start()
        self.engine.run()
        stuck = [d.index for d in self.devices if not d.done.done]
        assert not stuck, f"pipeline ranks {stuck} never finished: the schedule deadlocked"
        return self

    def peak_in_flight(self, r: int) -> float:
        """Peak live microbatch activations of rank r, in units of all its blocks."""
        return peak_in_flight(self.ranks[r].actions) / max(1, len(self.ranks[r].stages))
