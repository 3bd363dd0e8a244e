"""Ctrl-C and SIGTERM of a real `isthmus train`, and a loss that turns non-finite: one line, the right exit code.

Real signals to real processes after they logged a step: to the launcher alone (as `kill PID` does) and
to its whole process group (as Ctrl-C in a terminal does), on one process and on two ranks. The runs
go side by side to keep the wall time down; each is checked on its own.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from isthmus.checkpoint.manifest import verify_checkpoint
from procs import Train, descendants, gone, last_line, parent_of, session_gone, shm_files

SIGNAL_AT = 4
# name: (signal, ranks, to the whole process group, extra args)
SIGNALLED = {
    "sigint_one_process": (signal.SIGINT, 1, False, []),
    "sigterm_one_process": (signal.SIGTERM, 1, False, []),
    "sigint_two_ranks": (signal.SIGINT, 2, False, ["--checkpoint.async", "true"]),
    "sigterm_two_ranks": (signal.SIGTERM, 2, False, []),
    "ctrl_c_two_ranks": (signal.SIGINT, 2, True, []),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Train, list[int]]]:
    tmp = tmp_path_factory.mktemp("signals")
    cache = tmp / "cache"
    started = {
        name: Train(tmp / name, cache, "--parallel.nproc", str(n), "--checkpoint.every", "3", *extra)
        for name, (_, n, _, extra) in SIGNALLED.items()
    }
    started["nan_two_ranks"] = Train(
        tmp / "nan2",
        cache,
        "--parallel.nproc",
        "2",
        "--train.lr",
        "1e30",
        "--train.warmup_steps",
        "0",
        "--checkpoint.every",
        "1",
    )
    started["nan_one_process"] = Train(tmp / "nan1", cache, "--train.lr", "1e30", "--train.warmup_steps", "0")
    ranks: dict[str, list[int]] = {}
    for name, (signum, n, group, _) in SIGNALLED.items():
        run = started[name]
        run.wait_for_step(SIGNAL_AT)
        ranks[name] = [run.rank_pid(r) for r in range(n)] if n > 1 else []
        (os.killpg if group else os.kill)(run.proc.pid, signum)
    for run in started.values():
        run.wait()
    return {name: (run, ranks.get(name, [])) for name, run in started.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SIGNALLED))
def test_a_signal_stops_every_rank_in_one_line(name: str, runs: dict[str, tuple[Train, list[int]]]) -> None:
    signum, n, _, _ = SIGNALLED[name]
    run, rank_pids = runs[name]
    assert run.code == 128 + signum, run.err[-3000:]
    line = last_line(run.err)
    # e.g. "isthmus: interrupted (SIGINT) at step 7; the newest checkpoint is .../step-000006 (step 6):
    # continue with --checkpoint.resume .../step-000006"; an async save may still be in flight (cut short)
    cut = r"( \(the save of step \d+ was cut short and stays uncommitted\))?"
    head = rf"isthmus: interrupted \({signal.Signals(signum).name}\) at step (\d+); "
    m = re.fullmatch(
        head + rf"the newest checkpoint is (\S+) \(step (\d+)\){cut}: continue with --checkpoint.resume (\S+)", line
    )
    if m is None and "async" in " ".join(SIGNALLED[name][3]):
        m = re.fullmatch(
            head + rf"no checkpoint was saved yet \(checkpoint.every = 3\){cut}: a new run starts over", line
        )
        assert m, line
        assert not list((run.dir / "checkpoints").glob("step-??????"))
    else:
        assert m, line
        step, path, saved, _, resume = m.groups()
        assert int(step) >= SIGNAL_AT and int(saved) <= int(step) and path == resume
        # What it names is committed and whole; a save cut short stays a .partial (deleted by the next start).
        assert verify_checkpoint(Path(path)).step == int(saved)
    assert all(gone(pid) for pid in rank_pids), "a rank outlived the launcher"
    for log in (run.dir / "logs").glob("rank*.log"):  # the ranks said nothing either, not even in their logs
        assert "Traceback" not in log.read_text(), log


@pytest.mark.slow
def test_a_non_finite_loss_names_the_step_and_the_checkpoint(runs: dict[str, tuple[Train, list[int]]]) -> None:
    run, _ = runs["nan_two_ranks"]
    assert run.code == 3, run.err[-3000:]
    line = last_line(run.err)
    m = re.fullmatch(
        r"isthmus: error: loss is (nan|inf) at step (\d+); the newest checkpoint is (\S+) \(step (\d+)\): "
        r"continue with --checkpoint.resume \S+; lower train.lr \(now 1e\+30\) \(rank0\)",
        line,
    )
    assert m, line
    assert int(m.group(4)) == int(m.group(2)) - 1  # the step before: every finite step was saved
    assert verify_checkpoint(Path(m.group(3))).step == int(m.group(4))

    run, _ = runs["nan_one_process"]
    assert run.code == 3, run.err[-3000:]
    assert re.fullmatch(
        r"isthmus: error: loss is (nan|inf) at step \d+; nothing to resume from \(checkpoint.every = 0\): "
        r"a new run starts over; lower train.lr \(now 1e\+30\)",
        last_line(run.err),
    ), run.err[-2000:]


# name: what is done to a two-rank run after it logged a step (tests/procs' Train: a session of its own)
ENDINGS = {
    # A rank that cannot answer its signal (stopped here; deep in one long operation in the wild) while the
    # whole process group is signalled, as `timeout`, systemd and Slurm stop a job and a terminal sends Ctrl-C.
    "sigterm_group_stopped_rank": (signal.SIGTERM, "group"),
    "sigint_group_stopped_rank": (signal.SIGINT, "group"),
    "sighup_group_stopped_rank": (signal.SIGHUP, "group"),  # the terminal closed
    "sigkill_launcher": (signal.SIGKILL, "launcher"),
    "sigkill_rank_server": (signal.SIGKILL, "server"),
}


@pytest.fixture(scope="module")
def ended(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Train, list[int], set[Path], set[Path]]]:
    """Each run of ENDINGS after its ending: the processes of its session still alive 10 s after the
    signal, the /dev/shm files its processes had mapped, and those of them that are still there."""
    tmp = tmp_path_factory.mktemp("endings")
    started = {name: Train(tmp / name, tmp / "cache", "--parallel.nproc", "2") for name in ENDINGS}
    shm: dict[str, set[Path]] = {}
    signalled: dict[str, float] = {}
    for name, (signum, target) in ENDINGS.items():
        run = started[name]
        run.wait_for_step(SIGNAL_AT)
        rank1 = run.rank_pid(1)
        shm[name] = shm_files([run.proc.pid, *descendants(run.proc.pid)])
        if target == "group":
            os.kill(rank1, signal.SIGSTOP)
            os.killpg(run.proc.pid, signum)
        elif target == "launcher":
            os.kill(run.proc.pid, signum)
        else:
            os.kill(parent_of(rank1), signum)
        signalled[name] = time.monotonic()
    out = {}
    for name, run in started.items():
        left = session_gone(run.proc.pid, timeout=max(0.0, signalled[name] + 10 - time.monotonic()))
        left_cmd = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:200] for pid in left}
        for pid in left:  # (so that a failure leaves nothing running either)
            os.kill(pid, signal.SIGKILL)
        run.wait()
        out[name] = (run, left_cmd, shm[name], {f for f in shm[name] if f.exists()})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ENDINGS))
def test_no_process_of_a_run_outlives_its_ending(
    name: str, ended: dict[str, tuple[Train, list[int], set[Path], set[Path]]]
) -> None:
    run, left, mapped, kept = ended[name]
    assert not left, f"still alive 10 s after the signal: {left}"
    assert mapped and not kept, f"left in /dev/shm: {kept}"
    signum, target = ENDINGS[name]
    if target == "group":
        assert run.code == 128 + signum, run.err[-3000:]
        assert re.fullmatch(
            rf"isthmus: interrupted \({signal.Signals(signum).name}\) at step \d+; nothing to resume from "
            r"\(checkpoint.every = 0\): a new run starts over",
            last_line(run.err),
        )
    elif target == "launcher":
        assert run.code == -signal.SIGKILL
    else:
        assert run.code == 3, run.err[-3000:]
        assert re.fullmatch(
            r"isthmus: error: the rank server \(pid \d+\), which every rank is forked from, died \(SIGKILL\) "
            r"and its ranks with it; no restart \(parallel.max_restarts = 0\); see \S+/logs",
            last_line(run.err),
        )


@pytest.mark.slow
def test_a_run_the_suite_started_ends_with_the_suite(tmp_path: Path) -> None:
    """A test process killed outright (``timeout`` stopping the suite, a kill -9) takes the runs it
    started with it: their launcher is told (SIGTERM), and a launcher's ranks end with it (above)."""
    tests = Path(__file__).parents[1]
    script = (
        f"import sys, time; sys.path.insert(0, {str(tests)!r}); from pathlib import Path; from procs import Train; "
        f"run = Train(Path({str(tmp_path / 'run')!r}), Path({str(tmp_path / 'cache')!r})); "
        "print(run.proc.pid, flush=True); time.sleep(600)"
    )
    suite = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert suite.stdout is not None
        launcher = int(suite.stdout.readline())
        time.sleep(1)
        suite.kill()
        assert not session_gone(launcher, timeout=10), "the run outlived the process that started it"
    finally:
        suite.kill()
        suite.wait()
