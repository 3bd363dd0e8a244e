"""Pipeline schedules op by op: what each pipeline rank runs, in order, for one step.

These are the action lists of ``torch.distributed.pipelining`` (torch 2.13), which isthmus runs,
rewritten without torch so the simulator stays a pure function of the layout:

- ``gpipe``: every forward, then every backward (``ScheduleGPipe``);
- ``1f1b``: rank r runs ``min(m, pp - r)`` forwards, then alternates one backward and one
  forward, then the remaining backwards (``Schedule1F1B``);
- ``interleaved_1f1b``: v stages per rank, looping (stage s on rank s % pp); warm-up of
  ``(v - 1) * mb_per_round + 2 (pp - 1 - r)`` forwards, then 1F1B over rounds of
  ``m // max(1, m // pp)`` microbatches (``ScheduleInterleaved1F1B``);
- ``zero_bubble``: v = 2 is ZB-V (``ScheduleZBVZeroBubble``: stages r and 2 pp - 1 - r on rank r,
  so rank 0 holds both ends); v > 2 is interleaved zero bubble (``ScheduleInterleavedZeroBubble``).
  Both split the backward into an input-gradient part ``I`` and a weight-gradient part ``W``
  that is deferred to fill what would be bubbles.

An action is ``(kind, stage, microbatch)`` with kind ``F``, ``B`` (full backward), ``I`` or ``W``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

Action = tuple[str, int, int]


def stage_ranks(schedule: str, pp: int, virtual_stages: int) -> list[int]:
    """The pipeline rank of every stage (``pp * virtual_stages`` of them)."""
    v = max(1, virtual_stages)
    if schedule == "zero_bubble" and v == 2:
        return [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]
    return [s % pp for s in range(pp * v)]


def rank_actions(schedule: str, pp: int, virtual_stages: int, microbatches: int, rank: int) -> list[Action]:
    """Every compute action of pipeline rank ``rank`` in one step, in the order torch runs them."""
    m, v = microbatches, max(1, virtual_stages)
    if pp == 1:
        return [a for mb in range(m) for a in (("F", 0, mb), ("B", 0, mb))]
    if schedule == "gpipe":
        return [("F", rank, mb) for mb in range(m)] + [("B", rank, mb) for mb in range(m)]
    if schedule == "1f1b":
        warm = min(m, pp - rank)
        out: list[Action] = [("F", rank, mb) for mb in range(warm)]
        f = warm
        for b in range(m):
            out.append(("B", rank, b))
            if f < m:
                out.append(("F", rank, f))
                f += 1
        return out
    if schedule == "zero_bubble" and v == 2:
        return _zbv(pp, m, rank)
    zb = schedule == "zero_bubble"
    return _interleaved(pp, v, m, rank, zero_bubble=zb)


def _interleaved(pp: int, v: int, m: int, rank: int, zero_bubble: bool) -> list[Action]:
    rounds = max(1, m // pp)
    per_round = m // rounds
    warm = min((v - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank), m * v)
    total = m * v

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * pp + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warm) // per_round) % v) * pp + rank

    return _one_f_one_b(warm, total - warm, warm, fwd_stage, bwd_stage, rank if zero_bubble else None)


def _one_f_one_b(
    warm: int,
    steady: int,
    cooldown: int,
    fwd_stage: Callable[[int], int],
    bwd_stage: Callable[[int], int],
    zb_after: int | None,
) -> list[Action]:
    """torch's ``_get_1f1b_rank_ops`` without the alignment no-ops; ``zb_after``: weight passes start
    after that many steady backwards (zero bubble), None for full backwards."""
    fmb: dict[int, int] = defaultdict(int)
    bmb: dict[int, int] = defaultdict(int)
    wmb: dict[int, int] = defaultdict(int)
    out: list[Action] = []
    backward_steps: list[int] = []
    w_done = 0
    kind = "B" if zb_after is None else "I"

    def take(counter: dict[int, int], stage: int) -> int:
        mb = counter[stage]
        counter[stage] = mb + 1
        return mb

    def weight() -> None:
        nonlocal w_done
        stage = bwd_stage(backward_steps[w_done])
        out.append(("W", stage, take(wmb, stage)))
        w_done += 1

    for step in range(warm + steady + cooldown):
        if step < warm:
            s = fwd_stage(step)
            out.append(("F", s, take(fmb, s)))
            continue
        if step < warm + steady:
            s = fwd_stage(step)
            out.append(("F", s, take(fmb, s)))
        s = bwd_stage(step)
        out.append((kind, s, take(bmb, s)))
        backward_steps.append(step)
        if zb_after is not None and step - warm >= zb_after:
            weight()
    while zb_after is not None and w_done < len(backward_steps):
        weight()
    return out


def _zbv(pp: int, m: int, rank: int) -> list[Action]:
    """torch's ZB-V order for rank ``rank`` (microbatches beyond m dropped, as torch does)."""
    n = max(2 * pp - 1, m)
    c0, c1 = rank, 2 * pp - 1 - rank
    out: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (pp - rank) - 1):
        out.append(("F", c0, f0))
        f0 += 1
    for _ in range(rank):
        out.append(("F", c1, f1))
        f1 += 1
        out.append(("F", c0, f0))
        f0 += 1
    for _ in range(pp - rank):
        out.append(("F", c1, f1))
        f1 += 1
        out += [("I", c1, b1), ("W", c1, b1)]
        b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            out.append(("F", c0, f0))
            f0 += 1
        out += [("I", c0, b0), ("W", c0, b0)]
        b0 += 1
        out.append(("F", c1, f1))
        f1 += 1
        out += [("I", c1, b1), ("W", c1, b1)]
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        out.append(("I", c0, b0))
        b0 += 1
        out.append(("I", c1, b1))
        b1 += 1
    for _ in range(pp - rank):
        out.append(("I", c0, b0))
        b0 += 1
        out.append(("W", c0, w0))
        w0 += 1
    while w1 < b1:
        out.append(("W", c1, w1))
        w1 += 1
    while w0 < b0:
        out.append(("W", c0, w0))
        w0 += 1
    return [a for a in out if a[2] < m]


def peak_in_flight(actions: list[Action]) -> int:
    """Most microbatch-stages whose activations a rank holds at once (forward done, backward not)."""
    live = peak = 0
    for kind, _, _ in actions:
        if kind == "F":
            live += 1
            peak = max(peak, live)
        elif kind in ("B", "I"):
            live -= 1
    return peak
