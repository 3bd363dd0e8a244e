"""The discrete-event core: a clock, devices that run programs, links that share bandwidth.

A :class:`Device` runs one program (a generator of instructions) on its compute stream: compute
for a while, wait for something to happen, or start a transfer without waiting for it. A
:class:`Link` carries transfers with processor sharing: every flow on it has a *weight* (the
share of the link it uses when it runs at its nominal speed, as the cost model timed it) and
all active flows slow down together by the sum of their weights, or speed up when that sum is
below one (a flow never beats its ``min_stretch``). A :class:`Transfer` is a chain of phases
(latency, then bytes on one link), optionally queued behind the previous transfer of the same
:class:`Stream`, the way one NCCL/gloo communicator runs its collectives one after another. A
:class:`SlotLink` serves its transfers in turn instead, each with the whole link (time-shared WAN
slots, ``geo.wan_schedule = 'time_shared'``).

Everything is in seconds. Nothing here knows about models or layouts (program.py builds those).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

DONE_S = 1e-9
"""A flow with less than this many nominal seconds left is finished (float rounding of the clock)."""


class Token:
    """Something a program can wait for: a transfer's arrival, an op's end, a gathered weight."""

    __slots__ = ("done", "time", "waiters")

    def __init__(self) -> None:
        self.done = False
        self.time = 0.0
        self.waiters: list[Callable[[], None]] = []


@dataclass(frozen=True)
class Phase:
    """One leg of a transfer: a pure delay, then ``seconds`` of bytes at nominal speed on ``link``."""

    link: Link
    latency: float
    seconds: float
    weight: float = 1.0
    """Share of the link this flow takes at nominal speed (1: the whole link; see program.py for WAN)."""
    min_stretch: float = 0.0
    """Lower bound of the slow-down factor: a flow alone never runs faster than 1/min_stretch of nominal."""
    wan_bytes: float = 0.0
    """Bytes all devices this phase stands for send across datacenters (for the report)."""
    hold: float = 0.0
    """SlotLink only: seconds the link stays reserved after this flow (the slots of the others it stands for)."""


@dataclass(frozen=True)
class Event:
    """A finished interval, for the trace and the timeline."""

    track: str
    """'device:<i>' or 'link:<name>'."""
    lane: str
    """Stream inside the track: compute, tp, dp, p2p, or the link itself."""
    name: str
    cat: str
    """fwd, bwd, wgrad, recompute, optimizer, tp, cp, p2p, dp, wan."""
    start: float
    end: float
    args: tuple[tuple[str, Any], ...] = ()


class Engine:
    def __init__(self, record: bool = True) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.record = record
        self.events: list[Event] = []
        self.processed = 0

    def at(self, time: float, fn: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, fn, args))

    def fire(self, token: Token) -> None:
        token.done, token.time = True, self.now
        waiters, token.waiters = token.waiters, []
        for w in waiters:
            w()

    def run(self) -> None:
        heap = self._heap
        while heap:
            time, _, fn, args = heapq.heappop(heap)
            self.now = time
            self.processed += 1
            fn(*args)

    def log(self, track: str, lane: str, name: str, cat: str, start: float, end: float, **args: Any) -> None:
        if self.record and end > start:
            self.events.append(Event(track, lane, name, cat, start, end, tuple(args.items())))


class Link:
    """A link (one direction) shared by processor sharing among weighted flows."""

    __slots__ = ("engine", "name", "kind", "flows", "weight", "_last", "_version", "busy", "wan_bytes")

    def __init__(self, engine: Engine, name: str, kind: str) -> None:
        self.engine, self.name, self.kind = engine, name, kind
        self.flows: list[list[Any]] = []  # [remaining nominal seconds, weight, min_stretch, on_done]
        self.weight = 0.0
        """Sum of the active flows' weights: every flow runs at 1 / max(weight, its min_stretch) of nominal."""
        self._last = 0.0
        self._version = 0
        self.busy = 0.0
        """Seconds with at least one flow on the link."""
        self.wan_bytes = 0.0

    def _advance(self) -> None:
        now = self.engine.now
        dt = now - self._last
        if dt > 0 and self.flows:
            w = self.weight
            for f in self.flows:
                f[0] -= dt / (w if w > f[2] else f[2])
            self.busy += dt
        self._last = now

    def _reschedule(self) -> None:
        self._version += 1
        if not self.flows:
            return
        w = self.weight
        t = min((f[0] if f[0] > 0 else 0.0) * (w if w > f[2] else f[2]) for f in self.flows)
        self.engine.at(self.engine.now + t, self._complete, self._version)

    def add(
        self, seconds: float, weight: float, min_stretch: float, on_done: Callable[[], None], hold: float = 0.0
    ) -> None:
        assert hold == 0.0, "only a SlotLink reserves time after a flow"
        self._advance()
        self.flows.append([seconds, weight, min_stretch, on_done])
        self.weight += weight
        self._reschedule()

    def _complete(self, version: int) -> None:
        if version != self._version:
            return  # the set of flows changed since this completion was scheduled
        self._advance()
        done = [f for f in self.flows if f[0] <= DONE_S]
        if len(done) == len(self.flows):
            self.flows, self.weight = [], 0.0
        else:
            self.flows = [f for f in self.flows if f[0] > DONE_S]
            self.weight = sum(f[1] for f in self.flows)
        self._reschedule()
        for f in done:
            f[3]()


class SlotLink(Link):
    """A link (one direction) that serves its flows in turn, in time slots, instead of sharing.

    A flow waits until the link is free, takes all of it for its nominal ``seconds`` (weight and
    min_stretch do not apply), and leaves it reserved for ``hold`` seconds more: the slots of the
    other data-parallel pipelines that the simulated one stands for (program.py). The order is
    first come, first served, so the end of the last slot is all the state it needs.
    """

    __slots__ = ("free_at",)

    def __init__(self, engine: Engine, name: str, kind: str) -> None:
        super().__init__(engine, name, kind)
        self.free_at = 0.0

    def add(
        self, seconds: float, weight: float, min_stretch: float, on_done: Callable[[], None], hold: float = 0.0
    ) -> None:
        start = max(self.engine.now, self.free_at)
        self.free_at = start + seconds + hold
        self.busy += seconds + hold
        self.engine.at(start + seconds, on_done)


class Stream:
    """Transfers that run one after another (one communicator's queue)."""

    __slots__ = ("queue", "running")

    def __init__(self) -> None:
        self.queue: deque[Transfer] = deque()
        self.running = False


class Transfer:
    """A chain of phases; ``token`` fires when the last one ends."""

    __slots__ = (
        "engine",
        "phases",
        "name",
        "cat",
        "track",
        "lane",
        "token",
        "stream",
        "_i",
        "_start",
        "_phase_start",
        "on_done",
        "wan_log",
    )

    def __init__(
        self,
        engine: Engine,
        phases: list[Phase],
        name: str,
        cat: str,
        track: str,
        lane: str,
        stream: Stream | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        self.engine, self.phases, self.name, self.cat = engine, phases, name, cat
        self.track, self.lane, self.stream = track, lane, stream
        self.token = Token()
        self._i = 0
        self._start = self._phase_start = 0.0
        self.on_done = on_done
        self.wan_log: list[tuple[float, float]] | None = None
        """When set, (start, end) of each WAN phase is appended to it."""

    def start(self) -> None:
        """Begin now, or when the stream's earlier transfers are done."""
        s = self.stream
        if s is not None:
            if s.running:
                s.queue.append(self)
                return
            s.running = True
        self._begin()

    def _begin(self) -> None:
        self._start = self.engine.now
        self._next()

    def _next(self) -> None:
        eng = self.engine
        if self._i >= len(self.phases):
            eng.log(self.track, self.lane, self.name, self.cat, self._start, eng.now)
            eng.fire(self.token)
            if self.on_done is not None:
                self.on_done()
            s = self.stream
            if s is not None:
                if s.queue:
                    s.queue.popleft()._begin()
                else:
                    s.running = False
            return
        ph = self.phases[self._i]
        self._i += 1
        self._phase_start = eng.now
        if ph.latency > 0:
            eng.at(eng.now + ph.latency, self._bytes, ph)
        else:
            self._bytes(ph)

    def _bytes(self, ph: Phase) -> None:
        if ph.seconds <= 0:
            self._phase_done(ph)
            return
        ph.link.add(ph.seconds, ph.weight, ph.min_stretch, lambda: self._phase_done(ph), ph.hold)

    def _phase_done(self, ph: Phase) -> None:
        eng = self.engine
        ph.link.wan_bytes += ph.wan_bytes
        if self.wan_log is not None and ph.link.kind == "wan":
            self.wan_log.append((self._phase_start, eng.now))
        eng.log(
            "link:" + ph.link.name,
            ph.link.kind,
            self.name,
            "wan" if ph.link.kind == "wan" else self.cat,
            self._phase_start,
            eng.now,
        )
        self._next()


# Instructions a program yields to its device:
#   ("compute", seconds, name, cat, detail)   busy for seconds; detail: [(offset, dur, name, cat)] sub-intervals
#   ("wait", token)                           block until the token fires
#   ("start", transfer)                       start a transfer, do not wait
#   ("start_at", offset, transfer)            start it ``offset`` seconds from now (inside the next compute)
Program = Iterator[tuple[Any, ...]]


class Device:
    """One compute stream running one program.

    With ``host`` (a :class:`Link` standing for a host's CPU cores, `Topology.host_cores`) each
    compute is a flow on it of weight ``host_weight`` (the devices this one stands for over the
    cores) that never runs faster than nominal: while more devices compute than there are cores,
    all of them slow down together, as one-thread processes on a shared host do.
    """

    __slots__ = ("engine", "index", "track", "program", "busy", "by_cat", "finished", "done", "host", "host_weight")

    def __init__(
        self, engine: Engine, index: int, program: Program, host: Link | None = None, host_weight: float = 0.0
    ) -> None:
        self.engine, self.index, self.program = engine, index, program
        self.track = f"device:{index}"
        self.busy = 0.0
        self.by_cat: dict[str, float] = {}
        self.finished = 0.0
        self.done = Token()
        self.host, self.host_weight = host, host_weight

    def start(self) -> None:
        self.engine.at(self.engine.now, self._step)

    def _step(self) -> None:
        eng = self.engine
        for instr in self.program:
            op = instr[0]
            if op == "compute":
                _, seconds, name, cat, detail = instr
                if seconds <= 0:
                    continue
                if detail:
                    for _, dur, _, c in detail:
                        self.by_cat[c] = self.by_cat.get(c, 0.0) + dur
                else:
                    self.by_cat[cat] = self.by_cat.get(cat, 0.0) + seconds
                if self.host is not None:
                    self.host.add(seconds, self.host_weight, 1.0, partial(self._computed, eng.now, seconds, instr))
                else:
                    eng.at(eng.now + seconds, self._computed, eng.now, seconds, instr)
                return
            if op == "wait":
                token: Token = instr[1]
                if not token.done:
                    token.waiters.append(self._resume)
                    return
            elif op == "start":
                instr[1].start()
            elif op == "start_at":
                eng.at(eng.now + instr[1], instr[2].start)
            else:
                raise AssertionError(f"unknown instruction {op!r}")
        self.finished = eng.now
        eng.fire(self.done)

    def _computed(self, start: float, nominal: float, instr: tuple[Any, ...]) -> None:
        """A compute has ended (``nominal`` seconds of work, longer on a crowded host): log it, go on."""
        eng = self.engine
        _, _, name, cat, detail = instr
        self.busy += eng.now - start
        if eng.record:
            eng.log(self.track, "compute", name, cat, start, eng.now)
            stretch = (eng.now - start) / nominal
            for off, dur, sub, c in detail or ():
                if c in ("tp", "cp", "ep"):
                    eng.log(self.track, c, sub, c, start + off * stretch, start + (off + dur) * stretch)
        self._step()

    def _resume(self) -> None:
        self._step()
