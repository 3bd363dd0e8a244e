"""Useful work in pipeline bubbles: prefill of inference requests while a stage waits on a transfer.

A pipeline stage spends part of every step blocked on a P2P receive or send (the bubbles, which grow
when a stage boundary crosses a WAN). :func:`fill_stage` wraps a stage's four P2P op factories the way
``parallel.striped`` does: the schedule still batches and waits its ops as it always does, but each
op's work is a :class:`FilledWork` whose ``wait`` lets the :class:`BubbleFiller` run prefill chunks
(one request each) until the transfer has completed.

Why a waiter thread: gloo's send/receive works report ``is_completed()`` False until ``wait()`` has
been called (in torch 2.13, even a receive whose bytes have long arrived), so completion cannot be
polled. The filler hands the blocking ``wait()`` to one helper thread, which
only waits (gloo releases the GIL) and stamps the moment it returned; all computation, training and
prefill alike, stays on the main thread, between training ops, so torch's intra-op threads are never
shared by two computations at once.

No chunk may delay the next training op: the schedule is the same every step, so the ``k``-th wait of
a step is the same transfer each step (a *slot*). Each slot's gap (wait start to completion, stamped
by the waiter thread, so a chunk running past it does not inflate it) is measured every step; a chunk
starts only when its measured cost, with a margin, fits in what the slot's shortest recent gap has
left. Nothing is filled until a slot has two measurements (the first step also builds the schedule).

Even chunks that fit can slow the step: a chunk that overruns its gap, the hand-off from the waiter
thread back to the schedule, and on few cores the CPU a chunk takes from the transport, the other
ranks and an emulator's delay line (none of which the gaps show). :class:`FillGuard` backs off from
all three: a slot whose chunks overran gets a smaller budget, the waiter's observed wake-up latency
is kept free before each gap's end, and every few steps one step is left unfilled (a probe) so that
the filled steps' time can be compared with the unfilled ones': where filling made steps slower,
the share of each gap it may use is halved, down to nothing.

The filler never touches training state: its model is a separate frozen module, it runs under
``torch.inference_mode`` with autocast off, and it draws no random numbers.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage  # (imports torch._dynamo: only pipelined runs do)

COMPUTE = ("forward", "backward", "optimizer", "prefill")
"""Timeline categories that keep a rank busy (the others are waits)."""
GAP_HISTORY = 3
COST_HISTORY = 8
COST_MARGIN = 1.25
"""A chunk's predicted cost is the median of its recent measured costs times this."""
SLACK_S = 0.0005
"""Time kept free before a gap's expected end (Python overhead), besides the measured wake-up."""
PROBE_EVERY = 4
"""Every this many steps one is left unfilled, to compare filled steps' time against."""
STEP_TOLERANCE = 0.02
"""Filled steps more than this much slower than the unfilled probes halve the share of gaps filled."""
STEP_HISTORY = 3
"""How many recent filled and probe steps the comparison takes the median of."""
MIN_SCALE = 0.125
"""Below this share of each gap, fill nothing for the rest of the run."""
OVERRUN_PENALTY = 2.0
"""A slot's budget shrinks by this many times each overrun past its gap (halving when none)."""
WAKE_HISTORY = 16


@dataclass
class Request:
    """One prefill request: its id and prompt token ids."""

    id: str
    tokens: list[int]


@dataclass
class Event:
    name: str
    cat: str
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict)


class Timeline:
    """This rank's events (perf_counter seconds): training ops, waits, filler chunks, steps."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        # Wall clock of perf_counter 0, so that ranks (one machine, or clocks kept in step) line up.
        self.wall_offset = time.time() - time.perf_counter()

    def add(self, name: str, cat: str, start: float, end: float, **args: Any) -> None:
        self.events.append(Event(name, cat, start, end, args))

    @contextmanager
    def span(self, name: str, cat: str, **args: Any) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, cat, start, time.perf_counter(), **args)

    def busy_fraction(self, start: float, end: float) -> float:
        """Share of [start, end] covered by compute events (training ops and filler chunks)."""
        covered = 0.0
        for e in self.events:
            if e.cat in COMPUTE:
                covered += max(0.0, min(e.end, end) - max(e.start, start))
        return covered / (end - start) if end > start else 0.0

    def chrome_events(self, pid: int, label: str) -> list[dict[str, Any]]:
        """Chrome / Perfetto trace events (microseconds, wall clock), the format ``sim.trace`` writes:
        one process per rank, one thread for the training ops and waits, one for filler chunks."""
        lanes = {"prefill": 2, "step": 3}
        out: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "train"}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": 2, "args": {"name": "filler"}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": 3, "args": {"name": "steps"}},
        ]
        for e in self.events:
            out.append(
                {
                    "ph": "X",
                    "name": e.name,
                    "cat": e.cat,
                    "pid": pid,
                    "tid": lanes.get(e.cat, 1),
                    "ts": round((e.start + self.wall_offset) * 1e6, 3),
                    "dur": round((e.end - e.start) * 1e6, 3),
                    "args": dict(e.args),
                }
            )
        return out


@torch.inference_mode()
def prefill(model: nn.Module, tokens: list[int], device: torch.device) -> dict[str, Any]:
    """Prefill one prompt: the greedy next token and a hash of the last position's fp32 logits.

    The same function serves the filler and a plain run of the same requests, so equal inputs give
    bit-equal outputs (same kernels, same thread count)."""
    x = torch.tensor([tokens], dtype=torch.long, device=device)
    with torch.autocast(device.type, enabled=False):
        logits = model(x)[0, -1].float().cpu()
    return {
        "next_token": int(logits.argmax()),
        "logits_sha256": hashlib.sha256(logits.numpy().tobytes()).hexdigest(),
    }


class FillGuard:
    """How much of each gap the filler may use; pure bookkeeping on times it is given.

    Three measured back-offs: a slot's *penalty* (``OVERRUN_PENALTY`` times what its chunks ran past
    the transfer's completion, halved at each wait that did not overrun); a *wake margin* (the
    slowest recent hand-off from the waiter thread back to the schedule); and a *scale* on every gap,
    set by comparing the median time of recent filled steps with that of recent unfilled probe steps
    (every ``PROBE_EVERY``-th step; all ranks probe the same steps, as they count steps alike)."""

    def __init__(self, probe_every: int = PROBE_EVERY, tolerance: float = STEP_TOLERANCE) -> None:
        self.probe_every, self.tolerance = probe_every, tolerance
        self.scale = 1.0
        self.filling = False
        """Whether this step may be filled (not a probe, not the first, not given up)."""
        self.penalty: dict[int, float] = {}
        self.wakes: deque[float] = deque(maxlen=WAKE_HISTORY)
        self.filled_steps: deque[float] = deque(maxlen=STEP_HISTORY)
        self.probe_steps: deque[float] = deque(maxlen=STEP_HISTORY)
        self._seen = 0
        self._step_start = 0.0

    def begin_step(self, step: int, now: float, previous_filled: bool) -> None:
        """Close the previous step's timing, filled or not (this run's first step, which builds the
        schedule, is not compared); after an unfilled one, compare; decide whether ``step`` may be
        filled."""
        if self._seen:
            if previous_filled:
                self.filled_steps.append(now - self._step_start)
            elif self._seen > 1:
                self.probe_steps.append(now - self._step_start)
                self._compare()
        self._seen, self._step_start = self._seen + 1, now
        self.filling = self.scale > 0 and step % self.probe_every != 0

    def _compare(self) -> None:
        if not self.filled_steps or not self.probe_steps:
            return
        filled, probe = statistics.median(self.filled_steps), statistics.median(self.probe_steps)
        if filled > probe * (1 + self.tolerance):
            self.scale /= 2
            self.filled_steps.clear()  # the next verdict is on steps filled at the new scale
            if self.scale < MIN_SCALE:
                self.scale = 0.0
        else:
            self.scale = min(1.0, self.scale * 1.5)

    def wake_margin(self) -> float:
        return max(self.wakes, default=0.0)

    def budget(self, slot: int, expected_gap: float) -> float:
        """Seconds from the wait's start that chunks may take in ``slot``: 0 when this step is not
        filled."""
        if not self.filling:
            return 0.0
        usable = (expected_gap - SLACK_S - self.wake_margin()) * self.scale
        return max(0.0, usable - self.penalty.get(slot, 0.0))

    def record(self, slot: int, overrun: float, wake: float | None) -> None:
        """After a filled wait: how long its last chunk ran past the transfer's completion, and how
        long the schedule took to resume once both were done (None where a chunk was still running)."""
        if overrun > 0:
            self.penalty[slot] = self.penalty.get(slot, 0.0) + OVERRUN_PENALTY * overrun
        else:
            self.penalty[slot] = self.penalty.get(slot, 0.0) / 2
        if wake is not None:
            self.wakes.append(wake)


class BubbleFiller:
    """Runs this rank's share of the prefill requests in the waits of the pipeline schedule."""

    def __init__(
        self, model: nn.Module | None, requests: list[Request], device: torch.device, timeline: Timeline
    ) -> None:
        self.model = model
        self.pending: deque[Request] = deque(requests)
        self.device = device
        self.timeline = timeline
        self.results: list[dict[str, Any]] = []
        self.step = 0
        self.tokens_this_step = 0
        self._slot = 0
        self._gaps: dict[int, deque[float]] = {}
        self._costs: dict[int, deque[float]] = {}
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="isthmus-bubble-wait")
        self._low_priority = IdlePriority()
        self.guard = FillGuard()
        self._filled_this_step = False
        self.clock: Callable[[], float] = time.perf_counter

    # --- cost model ---------------------------------------------------------------------
    def calibrate(self) -> None:
        """Measure the prefill cost of the shortest and longest prompts, so that the first gaps can be
        filled; a first, unmeasured call warms the allocator and kernels. Outputs are discarded."""
        if self.model is None or not self.pending:
            return
        lengths = sorted({len(r.tokens) for r in self.pending})
        for n in {lengths[0], lengths[-1]}:
            prefill(self.model, [0] * n, self.device)
            for _ in range(COST_HISTORY):
                start = time.perf_counter()
                prefill(self.model, [0] * n, self.device)
                self._costs.setdefault(n, deque(maxlen=COST_HISTORY)).append(time.perf_counter() - start)

    def predicted_cost(self, n_tokens: int) -> float:
        """Seconds one prompt of ``n_tokens`` is expected to take, with a margin: its own recent costs,
        or else the highest measured cost per token times its length (attention grows faster than
        linearly, so per-token costs of the longest prompts overestimate shorter ones: safe)."""
        seen = self._costs.get(n_tokens)
        if seen:
            return statistics.median(seen) * COST_MARGIN
        per_token = max(statistics.median(c) / n for n, c in self._costs.items())
        return per_token * n_tokens * COST_MARGIN

    def expected_gap(self, slot: int) -> float | None:
        gaps = self._gaps.get(slot)
        return min(gaps) if gaps is not None and len(gaps) >= 2 else None

    # --- the hook -----------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.step, self._slot = step, 0
        if self.pending:
            self.guard.begin_step(step, self.clock(), self._filled_this_step)
        self._filled_this_step = False

    def wait(self, work: Any, name: str) -> None:
        """Wait for ``work``, running prefill chunks meanwhile when the slot's gap allows one."""
        slot, self._slot = self._slot, self._slot + 1
        start = self.clock()
        expected = self.expected_gap(slot)
        budget = self.guard.budget(slot, expected) if expected is not None else 0.0
        chunk_end: float | None = None
        if not self.pending or self._next_fitting(budget) is None:
            work.wait()
            done = self.clock()
            filled = False
        else:
            filled = True
            future: Future[float] = self._waiter.submit(_wait_and_stamp, work, self._low_priority.restore, self.clock)
            while not future.done():
                # Checked after every chunk: the transfer may have completed, the budget run out.
                request = self._next_fitting(budget - (self.clock() - start))
                if request is None:
                    break
                chunk_end = self._run(request, slot)
            done = future.result()  # re-raises a failed transfer's error here, on the main thread
        self._gaps.setdefault(slot, deque(maxlen=GAP_HISTORY)).append(done - start)
        end = self.clock()
        # overrun: how long a chunk kept the rank past the transfer's completion (the delay filling
        # caused); wake: from the later of completion and the last chunk's end to the schedule resuming.
        args: dict[str, Any] = {"slot": slot, "expected_ms": _ms(expected), "gap_ms": _ms(done - start)}
        args["overrun_ms"] = _ms(max(0.0, end - done))
        if filled:
            overrun = max(0.0, chunk_end - done) if chunk_end is not None else 0.0
            wake = end - max(done, chunk_end or done)
            self.guard.record(slot, overrun, wake if overrun == 0 else None)
            args.update(budget_ms=_ms(budget), chunk_overrun_ms=_ms(overrun), wake_ms=_ms(wake))
        self.timeline.add(name, "wait", start, end, **args)

    def _next_fitting(self, seconds: float) -> Request | None:
        # The first pending request that fits (requests are served in order when they fit); each
        # length's prediction is computed once per decision, as this runs between chunks.
        predicted: dict[int, float] = {}
        for i, r in enumerate(self.pending):
            if i >= 64:
                break
            n = len(r.tokens)
            if n not in predicted:
                predicted[n] = self.predicted_cost(n)
            if predicted[n] <= seconds:
                return r
        return None

    def _run(self, request: Request, slot: int | None) -> float:
        """Serve one request; returns when it ended."""
        assert self.model is not None  # requests come with a model
        self.pending.remove(request)
        predicted = self.predicted_cost(len(request.tokens)) if slot is not None else None
        start = self.clock()
        with self._low_priority if slot is not None else nullcontext():
            out = prefill(self.model, request.tokens, self.device)
        end = self.clock()
        self._costs.setdefault(len(request.tokens), deque(maxlen=COST_HISTORY)).append(end - start)
        in_bubble = slot is not None
        self.results.append(
            {"id": request.id, **out, "tokens": len(request.tokens), "step": self.step if in_bubble else None}
        )
        if in_bubble:
            self._filled_this_step = True
            self.tokens_this_step += len(request.tokens)
            self.timeline.add(
                f"prefill {request.id}",
                "prefill",
                start,
                end,
                tokens=len(request.tokens),
                slot=slot,
                predicted_ms=_ms(predicted),
            )
        return end

    def flush(self) -> int:
        """Run the requests no bubble had room for (after training); returns how many."""
        left = len(self.pending)
        while self.pending:
            self._run(self.pending[0], None)
        self._waiter.shutdown()
        return left


class IdlePriority:
    """Run a block at idle CPU priority on this thread, then restore it.

    Where the device is a CPU core shared with other work (the transport's threads, the other
    ranks, an emulator's forwarder), a filler chunk at normal priority takes CPU time from them and
    so slows training. Linux's SCHED_IDLE policy runs a thread only when nothing else wants the
    core, and a waking normal thread preempts it at once; nice 19 (the fallback where SCHED_IDLE is
    missing) still gets a 1.5% share and waits for the scheduler's tick to be preempted. Linux sets
    both per thread; going back to normal needs CAP_SYS_NICE (root), so without it this does nothing.
    """

    def __init__(self) -> None:
        self.tid = threading.get_native_id()
        self.normal = os.getpriority(os.PRIO_PROCESS, self.tid)
        self.enabled = sys.platform == "linux" and os.geteuid() == 0
        self.idle_policy = getattr(os, "SCHED_IDLE", None) if self.enabled else None
        self.normal_policy = os.sched_getscheduler(self.tid) if self.idle_policy is not None else None

    def __enter__(self) -> None:
        if self.idle_policy is not None:
            os.sched_setscheduler(self.tid, self.idle_policy, os.sched_param(0))
        elif self.enabled:
            os.setpriority(os.PRIO_PROCESS, self.tid, 19)

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def restore(self) -> None:
        """Back to normal priority; also called by the waiter thread the moment the transfer
        completes, so that a chunk running past it finishes at full speed."""
        if self.normal_policy is not None:
            os.sched_setscheduler(self.tid, self.normal_policy, os.sched_param(0))
        if self.enabled:
            os.setpriority(os.PRIO_PROCESS, self.tid, self.normal)


def _ms(seconds: float | None) -> float | None:
    return round(seconds * 1e3, 3) if seconds is not None else None


def _wait_and_stamp(work: Any, then: Callable[[], None], clock: Callable[[], float]) -> float:
    work.wait()
    done = clock()
    then()
    return done


class FilledWork:
    """A P2P work whose ``wait`` goes through the filler."""

    def __init__(self, work: Any, filler: BubbleFiller, name: str) -> None:
        self.work, self.filler, self.name = work, filler, name

    def wait(self, timeout: Any = None) -> bool:
        self.filler.wait(self.work, self.name)
        return True

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


FACTORIES = {
    "get_fwd_send_ops": "send activation",
    "get_fwd_recv_ops": "recv activation",
    "get_bwd_send_ops": "send gradient",
    "get_bwd_recv_ops": "recv gradient",
}


def fill_stage(stage: PipelineStage, filler: BubbleFiller) -> None:
    """Make every P2P op of ``stage`` hand the schedule a :class:`FilledWork`.

    Applied after any other wrapping of the same factories (``stripe_stage``): it wraps whatever
    ``op.op`` the inner factory left, and returns its work wrapped."""
    for factory_name, label in FACTORIES.items():
        factory = getattr(stage, factory_name)

        def wrapped(
            chunk_id: int, _factory: Callable[[int], list[dist.P2POp]] = factory, _label: str = label
        ) -> list[dist.P2POp]:
            return [_filled(op, filler, f"{_label} mb{chunk_id}") for op in _factory(chunk_id)]

        setattr(stage, factory_name, wrapped)


def _filled(op: dist.P2POp, filler: BubbleFiller, name: str) -> dist.P2POp:
    inner = op.op
    # batch_isend_irecv passes group_dst= or group_src= by testing `op.op is isend`, which a wrapped
    # op no longer is: a plain isend / irecv is called with its own peer keyword here.
    if inner is dist.isend:

        def run(tensor: torch.Tensor, **kw: Any) -> FilledWork:
            work = dist.isend(tensor, group=op.group, tag=op.tag, group_dst=op.group_peer)
            return FilledWork(work, filler, name)
    elif inner is dist.irecv:

        def run(tensor: torch.Tensor, **kw: Any) -> FilledWork:
            work = dist.irecv(tensor, group=op.group, tag=op.tag, group_src=op.group_peer)
            return FilledWork(work, filler, name)
    else:  # already wrapped (striped): it knows its peer and ignores the keywords

        def run(tensor: torch.Tensor, **kw: Any) -> FilledWork:
            return FilledWork(inner(tensor, **kw), filler, name)

    op.op = run
    return op


def time_stage(stage: PipelineStage, timeline: Timeline) -> None:
    """Record the stage's forward and backward chunks on ``timeline``."""
    for method, cat in (
        ("forward_one_chunk", "forward"),
        ("backward_one_chunk", "backward"),
        ("backward_weight_one_chunk", "backward"),
    ):
        inner = getattr(stage, method)

        def timed(*args: Any, _inner: Callable[..., Any] = inner, _cat: str = cat, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled() and _cat == "forward":
                return _inner(*args, **kwargs)  # forward-only validation: not a training op
            chunk = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id", "?"))
            with timeline.span(f"{_cat[0].upper()} s{stage.stage_index} mb{chunk}", _cat):
                return _inner(*args, **kwargs)

        setattr(stage, method, timed)
