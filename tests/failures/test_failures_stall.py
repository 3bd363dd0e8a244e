"""A rank that stops answering (SIGSTOP) is named by the launcher, every rank is stopped, exit 3."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from isthmus.launch.heartbeat import StallMonitor, read_beats
from isthmus.launch.local import last_logged_step
from multirank import run_ranks
from procs import Train, gone, last_line, session_gone

TIMEOUT_S = 8


@pytest.mark.slow
def test_a_stopped_rank_is_named_and_every_rank_stopped(tmp_path: Path) -> None:
    run = Train(tmp_path / "run", tmp_path / "cache", "--parallel.nproc", "2", "--parallel.timeout_s", str(TIMEOUT_S))
    run.wait_for_step(4)
    pids = [run.rank_pid(0), run.rank_pid(1)]
    stopped_at = time.monotonic()
    subprocess.run(["kill", "-STOP", str(pids[1])], check=True)
    code, err = run.wait(timeout=120)
    took = time.monotonic() - stopped_at
    assert code == 3, err[-3000:]
    line = last_line(err)
    m = re.fullmatch(
        r"isthmus: error: rank 1 stopped answering for (\d+) s \(last step it finished: (\d+)\); stopped every rank "
        rf"\(parallel.timeout_s = {TIMEOUT_S}\); see (\S+)",
        line,
    )
    assert m, line
    silent, step, logs = int(m.group(1)), int(m.group(2)), Path(m.group(3))
    assert TIMEOUT_S <= silent <= took + 1
    # Ranks move in lockstep, and rank 0 logs a step once the next one has computed (its loss is summed
    # over ranks meanwhile, train/step_sum.py): rank 1 last finished the step after the one rank 0
    # logged last, that one, or (stopped between finishing a step and reporting it) the one before.
    logged = last_logged_step(run.metrics)
    assert logged >= 4 and step in (logged - 1, logged, logged + 1)
    assert logs == run.dir / "logs" and (logs / "rank1.log").is_file()
    assert all(gone(pid) for pid in pids)
    assert took < TIMEOUT_S + 20, f"took {took:.0f} s to notice and stop"
    # Nothing of the run outlives its launcher for long: not the rank server, not the resource tracker.
    left = session_gone(run.proc.pid, timeout=5)
    assert not left, [Path(f"/proc/{pid}/cmdline").read_bytes()[:120] for pid in left]


def _beat(directory: Path, rank: int, pid: int, step: int, age: float) -> None:
    body = {"rank": rank, "pid": pid, "step": step, "time": time.time() - age}
    (directory / f"rank{rank}.beat").write_text(json.dumps(body))


def test_monitor_names_the_silent_live_rank_only(tmp_path: Path) -> None:
    """A beat too old from a live process is a stall; from a dead one it is not (a dead rank is the agent's)."""
    live = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        _beat(tmp_path, 0, live[0].pid, step=12, age=0.1)
        _beat(tmp_path, 2, dead.pid, step=3, age=100)
        monitor = StallMonitor(tmp_path, timeout_s=5)
        assert monitor.check(time.time()) is None
        _beat(tmp_path, 1, live[1].pid, step=11, age=6)
        assert [b.rank for b in read_beats(tmp_path)] == [0, 1, 2]
        stall = monitor.check(time.time())
        assert stall is not None and (stall.rank, stall.step) == (1, 11) and stall.silent_s >= 6
        # Every live rank was killed, the silent one (SIGKILL reaches a stopped process) and the others.
        assert [p.wait(timeout=10) for p in live] == [-signal.SIGKILL, -signal.SIGKILL]
    finally:
        for p in live:
            p.kill()
            p.wait()


def _late_peer(timeout_s: float, late_s: float) -> float | None:
    """Rank 0 waits on a subgroup (torch's 30-minute default) given ``timeout_s``; rank 1 never comes."""
    import torch
    import torch.distributed as dist

    from isthmus.train.trainer import set_group_timeouts

    group = dist.new_group([0, 1])
    set_group_timeouts(timeout_s, [group])  # (not the default group: the harness ends on a barrier there)
    if dist.get_rank() == 1:
        time.sleep(late_s)
        return None
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        dist.all_reduce(torch.ones(1), group=group)
    return time.monotonic() - start


@pytest.mark.slow
def test_group_timeouts_apply_to_groups_made_before() -> None:
    waited = run_ranks(_late_peer, 2, 2.0, 8.0, timeout=120, fresh=True)[0]  # its timed-out group stays broken
    assert waited is not None and 1.5 < waited < 6.0, waited
