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
"""Time kept free before a gap's expected end (the waiter thread's wake-up, Python overhead)."""


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

    def wait(self, work: Any, name: str) -> None:
        """Wait for ``work``, running prefill chunks meanwhile when the slot's gap allows one."""
        slot, self._slot = self._slot, self._slot + 1
        start = time.perf_counter()
        expected = self.expected_gap(slot)
        if expected is None or not self.pending or self._next_fitting(expected - SLACK_S) is None:
            work.wait()
            done = time.perf_counter()
        else:
            future: Future[float] = self._waiter.submit(_wait_and_stamp, work, self._low_priority.restore)
            while not future.done():
                left = expected - (time.perf_counter() - start) - SLACK_S
                request = self._next_fitting(left)
                if request is None:
                    break
                self._run(request, slot)
            done = future.result()  # re-raises a failed transfer's error here, on the main thread
        self._gaps.setdefault(slot, deque(maxlen=GAP_HISTORY)).append(done - start)
        end = time.perf_counter()
        # overrun: how long a chunk kept the rank past the transfer's completion (the delay filling caused).
        expected_ms = round(expected * 1e3, 3) if expected is not None else None
        overrun_ms = round(max(0.0, end - done) * 1e3, 3)
        self.timeline.add(name, "wait", start, end, slot=slot, expected_ms=expected_ms, overrun_ms=overrun_ms)

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

    def _run(self, request: Request, slot: int | None) -> None:
        assert self.model is not None  # requests come with a model
        self.pending.remove(request)
        start = time.perf_counter()
        with self._low_priority if slot is not None else nullcontext():
            out = prefill(self.model, request.tokens, self.device)
        end = time.perf_counter()
        self._costs.setdefault(len(request.tokens), deque(maxlen=COST_HISTORY)).append(end - start)
        in_bubble = slot is not None
        self.results.append(
            {"id": request.id, **out, "tokens": len(request.tokens), "step": self.step if in_bubble else None}
        )
        if in_bubble:
            self.tokens_this_step += len(request.tokens)
            self.timeline.add(f"prefill {request.id}", "prefill", start, end, tokens=len(request.tokens), slot=slot)

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


def _wait_and_stamp(work: Any, then: Callable[[], None]) -> float:
    work.wait()
    done = time.perf_counter()
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
