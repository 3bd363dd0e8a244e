"""A datacenter dies and comes back, in `isthmus emulate` (2 emulated datacenters x 2 ranks, real netns).

`--geo.fault_tolerant true` with diloco: the emulator serves a torchft Lighthouse on the bridge and
runs each datacenter as a job of its own with `--dc-restarts 1`. Once both have trained an outer round
together, every one of dc1's ranks is killed with SIGKILL (its torchrun agent stays: it restarts them). dc0
must keep training, with no pause longer than the lighthouse's heartbeat timeout, and complete all
its steps with a finite, falling loss; dc1's new ranks must rejoin at a later outer sync with the
global model and complete too. Needs root (ip netns, tc), as CI has.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from procs import isthmus_argv

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
        reason="needs root with ip and tc (network namespaces)",
    ),
]

STEPS, INNER = 120, 3


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:  # being written
            continue
        if "loss" in r:
            out.append(r)
    return out


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def _namespace(prefix_of: str) -> str:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split()
    hits = [n for n in names if n.startswith("ist-") and n.endswith(prefix_of)]
    assert len(hits) == 1, names
    return hits[0]


def _workers(namespace: str) -> list[int]:
    """The training ranks in ``namespace`` (not its torchrun agent, which restarts them).

    The agent forks its ranks from a forkserver it started (`isthmus.launch.warm`): a rank is a
    process whose parent is that server (the server's own parent is the agent)."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=True).stdout.split()

    def cmdline(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""

    def parent(pid: int) -> int:
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return 0

    return [
        pid
        for pid in map(int, pids)
        if b"multiprocessing.forkserver" in cmdline(parent(pid))
        and b"isthmus.launch.agent" in cmdline(parent(parent(pid)))
    ]


def _kill_workers(namespace: str, n: int, wait_s: float = 30) -> None:
    """SIGKILL the ``n`` training ranks of ``namespace`` at once, waiting until all ``n`` are up (a
    rank forked a moment late, or restarted, is not left out of the kill)."""
    deadline = time.monotonic() + wait_s
    while len(pids := _workers(namespace)) != n:
        assert time.monotonic() < deadline, f"{namespace} has ranks {pids}, not {n}"
        time.sleep(0.05)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("geo_emulated_failure")
    metrics = tmp / "metrics.jsonl"
    cmd = isthmus_argv(
        "emulate",
        "--topology",
        "emulated-2dc",
        "--wan-mbit",
        "10",
        "--timeout",
        "200",
        "--dc-restarts",
        "1",
        "--log-dir",
        str(tmp / "logs"),
        "--",
        "train",
        "--config",
        "tiny",
        "--geo.sync",
        "diloco",
        "--geo.inner_steps",
        str(INNER),
        "--geo.fault_tolerant",
        "true",
        "--geo.outer_dtype",
        "fp32",
        "--train.steps",
        str(STEPS),
        "--train.val_every",
        "0",
        "--train.val_batches",
        "1",
        "--data.max_bytes",
        "200000",
        "--train.run_dir",
        str(tmp / "run"),
        "--metrics.jsonl",
        str(metrics),
        "--metrics.progress",
        "false",
    )
    # Short torchft timeouts: a dead peer's collective fails in seconds, not minutes.
    env = {**os.environ, "TORCHFT_TIMEOUT_SEC": "20", "TORCHFT_QUORUM_TIMEOUT_SEC": "60"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    dc0, dc1 = metrics.with_name("metrics.dc0.jsonl"), metrics.with_name("metrics.dc1.jsonl")
    logs = tmp / "logs"
    deadline = time.monotonic() + 120
    try:
        # Kill once both datacenters have trained a round together (one that started late joins the
        # other at an outer sync first) and dc1 has gone on a little.
        while not (
            all("2 datacenter(s) in the quorum, 2 contributed" in _text(logs / f"dc{i}.log") for i in (0, 1))
            and _records(dc1)
            and _records(dc1)[-1]["step"] % INNER == 1
        ):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the datacenters did not train a round together"
            time.sleep(0.02)
        killed_at = _records(dc1)[-1]["step"]
        _kill_workers(_namespace("dc1"), 2)
        out, _ = proc.communicate(timeout=260)  # past emulate's own --timeout: its teardown runs first
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {
        "rc": proc.returncode,
        "out": out,
        "killed_at": killed_at,
        "left": left,
        "dc0": _records(dc0),
        "dc1": _records(dc1),
        "dc1_log": (tmp / "logs" / "dc1.log").read_text(),
    }


def test_survivor_completes_with_a_falling_loss(run: dict[str, Any]) -> None:
    assert run["rc"] == 0, run["out"][-3000:]
    # dc0 trains every step from its first to the last (when it started after dc1 it joined it
    # first, at an outer sync: then its first step follows that sync).
    steps = [r["step"] for r in run["dc0"]]
    assert steps == list(range(steps[0], STEPS + 1)) and (steps[0] - 1) % INNER == 0
    losses = [r["loss"] for r in run["dc0"]]
    assert all(math.isfinite(x) for x in losses)
    # Falling: from ln(256) = 5.55 nats of the untrained byte model (6.07 at step 1 here) to well below
    # (dc0 may have started from the global model of a datacenter that began first).
    assert sum(losses[-INNER:]) / INNER < 0.6 * math.log(256)
    assert sum(losses[-INNER:]) / INNER < max(losses)
    assert "datacenter dc1 ended" not in run["out"]  # dc1's agent restarted its ranks; it never gave up


def test_lost_datacenter_rejoins_from_the_global_model(run: dict[str, Any]) -> None:
    steps = [r["step"] for r in run["dc1"]]
    # The first generation's steps, up to the kill (a step or two may land after we read the
    # file), then a gap, then the second generation from an outer sync of the others to the end.
    cut = next(i for i in range(1, len(steps)) if steps[i] != steps[i - 1] + 1)
    first, second = steps[:cut], steps[cut:]
    assert first == list(range(first[0], first[-1] + 1)) and first[-1] >= run["killed_at"]
    assert second[0] > first[-1] + 1 and (second[0] - 1) % INNER == 0
    assert second == list(range(second[0], STEPS + 1))
    assert f"datacenter 1 rejoined at step {second[0] - 1} with the global model" in run["dc1_log"]
    assert all(math.isfinite(r["loss"]) for r in run["dc1"])


def test_no_namespace_is_left(run: dict[str, Any]) -> None:
    assert "ist-" not in run["left"]
