"""`isthmus emulate` as a user runs it: the README's commands, a clean console, and no leftovers.

- Bad train commands stop in the emulate process, before any namespace or rank exists, with one
  line and exit code 2; the README's command resolves to the topology's world.
- The README's diloco command (shortened) and its fault-tolerant example succeed with nothing on
  the console that looks like a failure (no traceback, no C++ trace or warning); in the
  fault-tolerant one both datacenters are in the quorum of every outer step and bytes cross the WAN.
  A run that fails once started ends with one line and exit code 3.
- SIGKILL of the `isthmus emulate` process mid-training: its reaper stops every rank and removes
  the run's namespaces and /dev/shm files within seconds.
- SIGKILL of a helper the emulator started (the WAN delay line, a datacenter's agent) mid-training:
  the run stops within seconds, ends with one line naming what died and exit code 3, and leaves no
  process, namespace or /dev/shm file behind.

The runs need root (ip netns, tc), as CI has; their traffic stays inside the namespaces they make.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from isthmus.cli import main
from procs import descendants, isthmus_argv, last_line, shm_files, tiny_run

needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="needs root with ip and tc (network namespaces)",
)

README_DILOCO = [
    "emulate",
    "--topology",
    "emulated-2dc",
    "--wan-mbit",
    "20",
    "--",
    "train",
    "--geo.sync",
    "diloco",
    "--geo.inner_steps",
    "20",
]
README_FAULT_TOLERANT = [
    "emulate",
    "--dc-restarts",
    "1",
    "--",
    "train",
    "--config",
    "tiny",
    "--geo.sync",
    "diloco",
    "--geo.inner_steps",
    "3",
    "--geo.fault_tolerant",
    "true",
    "--geo.outer_dtype",
    "fp32",
]
# What a failure on the console looks like: a Python traceback, a C++ exception's end, a reset
# connection, a c10d / gloo warning ("[W1204 08:48:50.796626641 socket.cpp:207] ...", maybe after "[rank1]:").
FAILURE_SIGNS = re.compile(r"Traceback|terminate called|Connection reset|\[W\d{4} ")


@pytest.fixture
def nothing_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tripwire: the test fails if emulate gets as far as making its network (patched where each
    is looked up: the command's own name for the launcher, and the first step of every network)."""
    from isthmus.cli import emulate
    from isthmus.launch import netns

    def tripwire(*args: Any, **kwargs: Any) -> int:
        raise AssertionError("isthmus emulate started a run")

    monkeypatch.setattr(emulate, "launch_emulated", tripwire)
    monkeypatch.setattr(netns, "require_root", tripwire)


@pytest.mark.parametrize(
    "train, key",
    [
        (["--parallel.nproc", "2"], "parallel.nproc = 2: the topology emulated-2dc runs 4 ranks"),
        (["--geo.datacenters", "3"], "geo.datacenters = 3: the topology emulated-2dc has 2 datacenters"),
        (["--config", "tiny", "--train.batch_size", "6"], "train.batch_size = 6: must be divisible by dp (4)"),
        (["--config", "tiny", "--parallel.tp", "3"], "parallel.nproc = 4: must be a multiple of"),
        (
            ["--config", "tiny", "--geo.sync", "flat", "--geo.fault_tolerant", "true"],
            "geo.fault_tolerant = True: needs",
        ),
        (
            ["--config", "tiny", "--parallel.max_restarts", "1", "--checkpoint.every", "5"],
            "parallel.max_restarts = 1: is not used by isthmus emulate",
        ),
        (["--model.flavor", "nope"], "model.flavor = 'nope'"),
    ],
)
def test_a_bad_train_command_is_one_line_before_anything_starts(
    nothing_launched: None, capsys: pytest.CaptureFixture[str], train: list[str], key: str
) -> None:
    rc = main(["emulate", "--", "train", *train])
    out, err = capsys.readouterr()
    assert rc == 2
    assert err.splitlines() == [err.strip()] and err.startswith(f"isthmus: error: {key}"), err
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ  # the rank's view was put back


def _toml(text: str) -> dict[str, Any]:
    import tomllib

    return tomllib.loads(text)


def test_readme_commands_resolve_to_the_topologys_world(
    nothing_launched: None, capsys: pytest.CaptureFixture[str]
) -> None:
    # The shipped default says nproc = 2 for a local run; emulated, the world is 2 datacenters x 2.
    assert main([*README_DILOCO, "--print-config"]) == 0
    cfg = _toml(capsys.readouterr().out)
    assert (cfg["parallel"]["nproc"], cfg["parallel"]["dp_replicate"], cfg["geo"]["datacenters"]) == (4, 2, 2)
    # Fault tolerant: each datacenter is a job of its 2 ranks; the layout still spans both.
    assert main([*README_FAULT_TOLERANT, "--print-config"]) == 0
    cfg = _toml(capsys.readouterr().out)
    assert (cfg["parallel"]["nproc"], cfg["parallel"]["dp_replicate"], cfg["geo"]["datacenters"]) == (2, 2, 2)


def _records(path: Path) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r] if path.is_file() else []


@pytest.fixture(scope="module")
def readme_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The README's two emulate commands, side by side, their console output captured."""
    tmp = tmp_path_factory.mktemp("emulate_readme")
    common = ["--train.run_dir", "{dir}/run", "--metrics.jsonl", "{dir}/metrics.jsonl", "--metrics.progress", "false"]
    commands = {
        # Shortened: the tiny flavor, one outer step at step 20.
        "diloco": [
            *README_DILOCO,
            "--model.flavor",
            "tiny",
            "--train.steps",
            "20",
            "--train.val_every",
            "0",
            "--data.max_bytes",
            "200000",
            *common,
        ],
        # As printed: the tiny config is 20 steps already.
        "fault_tolerant": [*README_FAULT_TOLERANT, *common],
        # A run that fails once started: the loss becomes NaN within a few steps on every rank.
        "fails": ["emulate", "--", "train", "--config", "tiny", "--train.lr", "1e12", "--train.steps", "10", *common],
    }
    started = {}
    for name, argv in commands.items():
        out = tmp / name
        out.mkdir()
        argv = [a.replace("{dir}", str(out)) for a in argv]
        started[name] = (
            subprocess.Popen(isthmus_argv(*argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
            out,
        )
    runs = {}
    for name, (proc, out) in started.items():
        console, _ = proc.communicate(timeout=300)
        runs[name] = {"rc": proc.returncode, "console": console, "dir": out}
    return runs


@needs_root
@pytest.mark.slow
@pytest.mark.parametrize("name", ["diloco", "fault_tolerant"])
def test_a_successful_run_prints_no_traceback_or_cpp_trace(readme_runs: dict[str, dict[str, Any]], name: str) -> None:
    run = readme_runs[name]
    assert run["rc"] == 0, run["console"][-3000:]
    assert "isthmus train: done" in run["console"]
    bad = [line for line in run["console"].splitlines() if FAILURE_SIGNS.search(line)]
    assert bad == [], "\n".join(bad)


@needs_root
@pytest.mark.slow
def test_a_failed_run_ends_in_one_line_and_exit_3(readme_runs: dict[str, dict[str, Any]]) -> None:
    run = readme_runs["fails"]
    assert run["rc"] == 3, run["console"][-3000:]
    lines = run["console"].splitlines()
    # The last line is the rank's own: the step whose loss or gradient norm stopped being finite.
    assert re.match(
        r"isthmus: error: the emulated run failed: (loss|gradient norm) is (nan|inf).* at step \d+; .*"
        r"lower train\.lr \(now 1e\+12\) \(rank \d\); its ranks' output is above$",
        lines[-1],
    ), lines[-1]
    # ...and the launchers add no traceback of their own (ChildFailedError, SignalException).
    assert not any("torch/distributed/run.py" in line or "SignalException" in line for line in lines), run["console"]


def _wan_bytes_in_summaries(console: str) -> list[float]:
    """The WAN bytes of each `isthmus train: done` table ("wan 5.0 MiB"), in bytes."""
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    rows = [line for line in console.splitlines() if "bytes sent" in line]
    return [float(m[1]) * scale[m[2]] for row in rows for m in [re.search(r"wan (\d+(?:\.\d+)?) (\w+)", row)] if m]


@needs_root
@pytest.mark.slow
def test_readme_diloco_command_sends_its_outer_step_over_the_wan(readme_runs: dict[str, dict[str, Any]]) -> None:
    run = readme_runs["diloco"]
    records = _records(run["dir"] / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 21))
    assert [r["step"] for r in records if r["wan_bytes"] > 0] == [20]
    assert _wan_bytes_in_summaries(run["console"])[0] > 0


@needs_root
@pytest.mark.slow
def test_fault_tolerant_example_has_both_datacenters_in_every_quorum(readme_runs: dict[str, dict[str, Any]]) -> None:
    run = readme_runs["fault_tolerant"]
    assert run["rc"] == 0, run["console"][-3000:]
    console = run["console"]
    for dc in (0, 1):
        # The first quorum (step 0) and the outer step after every 3 inner steps, all with both.
        rounds = re.findall(
            rf"outer round at step (\d+) \(datacenter {dc}\): (\d+) datacenter\(s\) in the quorum", console
        )
        assert [(int(s), int(n)) for s, n in rounds] == [(t, 2) for t in range(0, 20, 3)], rounds
        records = _records(run["dir"] / f"metrics.dc{dc}.jsonl")
        assert [r["step"] for r in records] == list(range(1, 21))  # no datacenter started late and skipped steps
        assert [(r["step"], r["dc_quorum"]) for r in records if "dc_quorum" in r] == [(t, 2) for t in range(3, 20, 3)]
        assert sum(r["wan_bytes"] for r in records) > 0
    wan = _wan_bytes_in_summaries(console)
    assert len(wan) == 2 and all(b > 0 for b in wan), wan


def _run_namespaces(log: Path, deadline: float) -> str:
    """The ``ist-<id>-`` prefix the emulate run writing ``log`` made (from its own log line)."""
    while time.monotonic() < deadline:
        m = re.search(r"in namespaces (ist-[0-9a-f]{6}-)\*", log.read_text())
        if m:
            return m.group(1)
        time.sleep(0.1)
    raise AssertionError(f"the run never said where it runs:\n{log.read_text()[-2000:]}")


def _pids_in(prefix: str) -> set[int]:
    from isthmus.launch import netns

    return {pid for name in netns.list_namespaces(prefix) for pid in netns.namespace_pids(name)}


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _run_processes(root: int, prefix: str) -> set[int]:
    """Every process of the emulate run ``root``: its descendants (the reaper, the helpers, the agents and
    their ranks) and whatever runs in its namespaces."""
    return {*descendants(root), *_pids_in(prefix)}


def _seconds_until_nothing_is_left(prefix: str, pids: set[int], shm: set[Path], since: float, limit_s: float) -> float:
    """Seconds from ``since`` until no process of ``pids``, namespace of ``prefix`` or file of ``shm`` is left."""
    from isthmus.launch import netns

    while True:
        left = (
            [p for p in pids if _alive(p)],
            netns.list_namespaces(prefix),
            [f for f in shm if f.exists()],
            list(netns.NETNS_ETC.glob(f"{prefix}*")),
        )
        if not any(left):
            return time.monotonic() - since
        assert time.monotonic() < since + limit_s, f"left {limit_s:g} s after the kill: {left}"
        time.sleep(0.1)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


# What to kill, told by what its command line holds, and how the last line names it.
HELPERS = {
    "delay_line": (("isthmus.launch.delayline",), "the WAN delay line between dc0 and dc1"),
    "agent_of_dc1": (("isthmus.launch.agent", "--local-addr 10.213.0.101"), "the torchrun agent of dc1"),
}


@needs_root
@pytest.mark.slow
@pytest.mark.parametrize("helper", list(HELPERS))
def test_a_helper_killed_mid_training_stops_the_run_and_is_named(tmp_path: Path, helper: str) -> None:
    """A dead helper used to hang the ranks until their collectives timed out, then blame a rank."""
    from isthmus.launch import netns
    from isthmus.launch.local import last_logged_step

    marks, named = HELPERS[helper]
    metrics = tmp_path / "metrics.jsonl"
    argv = [
        *("emulate", "--topology", "emulated-2dc", "--wan-rtt-ms", "40", "--log-dir", str(tmp_path / "logs")),
        *("--", "train", *tiny_run(400), "--train.run_dir", str(tmp_path / "run")),
        *("--metrics.jsonl", str(metrics), "--metrics.progress", "false"),
    ]
    err_path = tmp_path / "emulate.err"
    with err_path.open("w") as err:
        proc = subprocess.Popen(isthmus_argv(*argv), stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL)
    prefix = None
    try:
        deadline = time.monotonic() + 180
        prefix = _run_namespaces(err_path, deadline)
        while last_logged_step(metrics) < 1:
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-3000:]
            time.sleep(0.1)
        pids = _run_processes(proc.pid, prefix)
        shm = shm_files(list(pids))
        target = [p for p in pids if all(m in _cmdline(p) for m in marks)]
        assert len(target) == 1, [_cmdline(p) for p in pids]
        os.kill(target[0], signal.SIGKILL)
        killed = time.monotonic()
        rc = proc.wait(timeout=10)
        assert rc == 3, err_path.read_text()[-3000:]
        assert last_line(err_path.read_text()) == (
            f"isthmus: error: the emulated run failed: {named} (pid {target[0]}) died (killed by SIGKILL); "
            "stopped every datacenter and removed the network; "
            "nothing to resume from (checkpoint.every = 0): a new run starts over"
        )
        _seconds_until_nothing_is_left(prefix, pids, shm, killed, 10.0)
    finally:
        if proc.poll() is None:
            proc.kill()  # its reaper removes the rest
            proc.wait()
        if prefix is not None:
            netns.delete_prefix(prefix)


@needs_root
@pytest.mark.slow
def test_sigkill_of_emulate_mid_training_stops_every_rank_and_removes_the_network(tmp_path: Path) -> None:
    from isthmus.launch import netns

    log, metrics = tmp_path / "emulate.log", tmp_path / "metrics.jsonl"
    argv = [
        "emulate",
        "--",
        "train",
        "--config",
        "tiny",
        "--geo.sync",
        "diloco",
        "--geo.inner_steps",
        "3",
        "--train.steps",
        "100000",
        "--train.val_every",
        "0",
        "--data.max_bytes",
        "200000",
        "--train.run_dir",
        str(tmp_path / "run"),
        "--metrics.jsonl",
        str(metrics),
        "--metrics.progress",
        "false",
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(isthmus_argv(*argv), stdout=out, stderr=subprocess.STDOUT)
    prefix = None
    try:
        deadline = time.monotonic() + 180
        prefix = _run_namespaces(log, deadline)
        while len(_records(metrics)) < 2:  # training, across both datacenters
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        assert len(_pids_in(prefix)) >= 6  # 2 agents + 4 ranks, and the rendezvous store
        pids = _run_processes(proc.pid, prefix)
        shm = shm_files(list(pids))
        proc.send_signal(signal.SIGKILL)  # no teardown of its own can run
        killed = time.monotonic()
        proc.wait(timeout=10)
        _seconds_until_nothing_is_left(prefix, pids, shm, killed, 10.0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if prefix is not None:  # what a failed check leaves is not left for other tests
            netns.delete_prefix(prefix)


def test_a_launcher_failing_after_every_rank_finished_is_a_success(tmp_path: Path) -> None:
    """A datacenter's launcher that aborts while shutting down (seen once: a C++ thread torn down at
    exit) after every rank wrote its done mark leaves a run that succeeded; a rank short, the same
    code is the interruption it says it is."""
    from isthmus.cli.emulate import _exit_code
    from isthmus.errors import Interrupted
    from isthmus.launch.local import write_rank_done

    for rank in range(3):
        write_rank_done(tmp_path, rank, 8)
    with pytest.raises(Interrupted, match="SIGTERM"):
        _exit_code(128 + signal.SIGTERM, None, None, tmp_path, world=4)
    write_rank_done(tmp_path, 3, 8)
    assert _exit_code(128 + signal.SIGTERM, None, None, tmp_path, world=4) == 0
    assert _exit_code(1, None, None, tmp_path, world=4) == 0
