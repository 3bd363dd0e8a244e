"""Elastic shrink and regrow on emulated hosts: a host dies mid-run, the other continues from the
newest checkpoint at the smaller world; the host comes back and the run grows to it again.

Each host runs torchrun as on a real node (``--nnodes 1:2 --max-restarts 3``, c10d on host0). Every
sample a rank draws is recorded by a ``sitecustomize`` the test puts on the ranks' PYTHONPATH
(around `BatchSampler.next_batch`; the library has no test hook), so the test sees which samples
each attempt trained on, not only the data position the checkpoints keep.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest

import isthmus
from isthmus.launch.hosts import EmulatedHosts, torchrun_argv
from isthmus.launch.local import last_logged_step
from procs import needs_hosts, run_isthmus, tiny_run

pytestmark = [
    pytest.mark.slow,
    needs_hosts,
]

STEPS, EVERY, BATCH = 32, 4, 8

RECORDER = """
import json, os, socket, time
if os.environ.get("SAMPLES_DIR"):
    from isthmus.data import loader
    _next = loader.BatchSampler.next_batch
    def next_batch(self, global_batch, dp_rank=0, dp_size=1):
        ids = self.sample_ids(global_batch)[loader.rank_slice(global_batch, dp_rank, dp_size)]
        attempt = os.environ["MASTER_ADDR"] + ":" + os.environ["MASTER_PORT"]
        row = {"attempt": attempt, "t": time.time(), "pos": self.samples_seen, "dp": dp_size, "dp_rank": dp_rank,
               "ids": [int(i) for i in ids]}
        with open(os.path.join(os.environ["SAMPLES_DIR"], f"{socket.gethostname()}.{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\\n")
        while os.path.exists(os.path.join(os.environ["SAMPLES_DIR"], "hold")):  # the test holds the ranks
            time.sleep(0.05)
        return _next(self, global_batch, dp_rank, dp_size)
    loader.BatchSampler.next_batch = next_batch
"""


def _args(run: Path, cache: Path) -> list[str]:
    return [
        *tiny_run(STEPS, BATCH),
        *("--checkpoint.every", str(EVERY), "--checkpoint.keep", "100", "--metrics.log_every", "1"),
        *("--train.run_dir", str(run), "--data.cache_dir", str(cache)),
    ]


def _wait_for_step(run: Path, step: int, proc: subprocess.Popen[str], timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while (reached := last_logged_step(run / "metrics.jsonl")) < step:
        assert proc.poll() is None, f"host0's agent ended ({proc.returncode}) before step {step}"
        assert time.monotonic() < deadline, f"no step {step} within {timeout} s"
        time.sleep(0.05)
    return reached


def _final_losses(metrics: Path) -> dict[int, float]:
    """Each step's loss as the run that went on logged it (a step redone after a restart: its last line)."""
    return {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r}


def _kept_samples(records: Path) -> tuple[list[int], list[list[int]]]:
    """The sample ids the run kept, in order, and each attempt's dp degree per global batch.

    An attempt (one rendezvous: one MASTER_ADDR:PORT) keeps the batches before the position the
    next attempt resumed from; what it drew after that was lost with its host (or its restart).
    """
    draws: dict[str, list[dict]] = defaultdict(list)
    for path in records.glob("*.jsonl"):
        for row in map(json.loads, path.read_text().splitlines()):
            draws[row["attempt"]].append(row)
    attempts = sorted(draws.values(), key=lambda rows: min(r["t"] for r in rows))
    kept: list[int] = []
    dps: list[list[int]] = []
    for i, rows in enumerate(attempts):
        end = min(r["pos"] for r in attempts[i + 1]) if i + 1 < len(attempts) else None
        by_pos: dict[int, list[dict]] = defaultdict(list)
        for r in rows:
            if end is None or r["pos"] < end:
                by_pos[r["pos"]].append(r)
        for pos in sorted(by_pos):
            slices = sorted(by_pos[pos], key=lambda r: r["dp_rank"])
            dp = slices[0]["dp"]
            assert [r["dp_rank"] for r in slices] == list(range(dp)), (pos, slices)
            kept += [i for r in slices for i in r["ids"]]
        dps.append(sorted({r["dp"] for r in rows}))
    return kept, dps


def test_a_host_dies_the_run_shrinks_and_grows_back(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(RECORDER)
    samples = tmp_path / "samples"
    samples.mkdir()
    run, cache = tmp_path / "run", tmp_path / "cache"
    src = str(Path(isthmus.__file__).resolve().parents[1])
    env = {
        "PYTHONPATH": os.pathsep.join([str(site), src]),
        "SAMPLES_DIR": str(samples),
        "ISTHMUS_CACHE": str(cache),
        # torch's agents share their rendezvous store with the ranks by default; then a node that
        # joins a later round waits forever for the rank-0 node's address (torch 2.13), so it is off.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
    }
    # last_call_timeout: how long a rendezvous with fewer than 2 nodes waits for more (torch: 30 s):
    # long enough for both hosts to meet at the start, short for the restart on host 0 alone.
    elastic = ["--checkpoint.resume", "auto"]  # every start continues from the newest checkpoint
    target = ["--rdzv-conf", "last_call_timeout=5", "-m", "isthmus", "train", *_args(run, cache), *elastic]
    argv = torchrun_argv("1:2", 1, "host0:29400", f"elastic-{os.getpid()}", target, max_restarts=3)
    with EmulatedHosts(2) as hosts:

        def start(i: int, name: str) -> subprocess.Popen[str]:
            out = open(tmp_path / f"{name}.out", "w")  # noqa: SIM115 (closed with the process)
            return hosts.popen(i, argv, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)

        host0 = start(0, "host0")
        host1 = start(1, "host1")
        reached = _wait_for_step(run, EVERY + 2, host0)
        hosts.kill(1)
        host1.wait(timeout=30)
        _wait_for_step(run, 3 * EVERY + 1, host0)  # past a checkpoint of the run at world 1
        # Hold every rank at its next batch until the returning host's rank has drawn one: a fast host0
        # could otherwise finish its steps before host1's agent starts and joins (torch's agent takes a
        # waiting node in only between its checks), and host1 would find no store.
        hold = samples / "hold"
        hold.touch()
        before = set(samples.glob("host1.*"))
        host1 = start(1, "host1-again")
        deadline = time.monotonic() + 120
        while not set(samples.glob("host1.*")) - before:
            assert host0.poll() is None and host1.poll() is None, "an agent ended before host1 rejoined"
            assert time.monotonic() < deadline, "host1 drew no batch within 120 s of its return"
            time.sleep(0.05)
        hold.unlink()
        assert host0.wait(timeout=180) == 0, (tmp_path / "host0.out").read_text()[-3000:]
        assert host1.wait(timeout=60) == 0, (tmp_path / "host1-again.out").read_text()[-3000:]
    out = (tmp_path / "host0.out").read_text()

    # One line each time the hosts change: what was lost, and the world the run goes on at.
    left = re.findall(
        r"isthmus: host1 left \(rank 1\); resuming from step (\d+) \((\d+) steps? lost\) at world 1, dp 1", out
    )
    assert len(left) == 1, out[-4000:]
    shrunk_from, lost = map(int, left[0])
    assert shrunk_from % EVERY == 0 and shrunk_from <= reached and lost >= reached - shrunk_from, (left, reached)
    joined = re.findall(
        r"isthmus: host1 joined \(rank 1\); resuming from step (\d+) \((\d+) steps? lost\) at world 2, dp 2", out
    )
    assert len(joined) == 1, out[-4000:]
    grown_from = int(joined[0][0])
    assert shrunk_from < grown_from < STEPS and grown_from % EVERY == 0

    # Every sample exactly once: the batches kept before the host died, then those at world 1 up to the
    # checkpoint the regrown run resumed from, then those at dp 2 again; each global batch whole.
    kept, dps = _kept_samples(samples)
    assert dps == [[2], [1], [2]], dps
    assert len(kept) == STEPS * BATCH and len(set(kept)) == len(kept)

    # The losses after each resume are those of a run resumed from the same checkpoint at the same world,
    # to the end (ISTHMUS_MAX_STEPS would shorten its LR schedule). Same arithmetic in the same order
    # (gloo's all-reduce of 2 ranks on loopback and across hosts alike): equal within 1e-6 (0 measured).
    losses = _final_losses(run / "metrics.jsonl")
    assert sorted(losses) == list(range(1, STEPS + 1))
    for name, start_at, end_at, layout in [
        ("at-world-1", shrunk_from, grown_from, []),
        ("at-world-2", grown_from, STEPS, ["--parallel.nproc", "2"]),
    ]:
        ref = tmp_path / name
        checkpoint = run / "checkpoints" / f"step-{start_at:06d}"
        done = run_isthmus(
            "train",
            *_args(ref, cache),
            *layout,
            *("--checkpoint.resume", str(checkpoint), "--checkpoint.every", "0"),
            env={"ISTHMUS_CACHE": str(cache)},
        )
        assert done.returncode == 0, done.stderr[-3000:]
        ref_losses = _final_losses(ref / "metrics.jsonl")
        assert sorted(ref_losses) == list(range(start_at + 1, STEPS + 1))
        for step in range(start_at + 1, end_at + 1):
            assert abs(losses[step] - ref_losses[step]) <= 1e-6, (name, step, losses[step], ref_losses[step])


def test_a_layout_that_cannot_shrink_ends_in_one_line(tmp_path: Path) -> None:
    run, cache = tmp_path / "run", tmp_path / "cache"
    src = str(Path(isthmus.__file__).resolve().parents[1])
    env = {"PYTHONPATH": src, "ISTHMUS_CACHE": str(cache), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    # Tensor parallel across the two hosts: one host alone cannot hold both halves of each layer.
    target = ["--rdzv-conf", "last_call_timeout=5", "-m", "isthmus", "train", *_args(run, cache)]
    target += ["--checkpoint.resume", "auto", "--parallel.tp", "2"]
    argv = torchrun_argv("1:2", 1, "host0:29400", f"elastic-{os.getpid()}", target, max_restarts=1)
    with EmulatedHosts(2) as hosts:
        host0 = hosts.popen(0, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        host1 = hosts.popen(1, argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for_step(run, EVERY + 1, host0)
        hosts.kill(1)
        host1.wait(timeout=30)
        out, _ = host0.communicate(timeout=120)
    assert host0.returncode == 3, out[-3000:]
    lines = [line for line in out.splitlines() if "cannot continue" in line]
    assert len(lines) == 1, out[-3000:]
    assert lines[0].startswith(
        "isthmus: error: host1 left (rank 1): the run cannot continue at world 1: parallel.nproc = 1: "
        "must be a multiple of dp_shard*cp*tp*pp = 1*1*2*1 = 2"
    ), lines
