"""A job on two emulated hosts (`isthmus.launch.hosts`): each host's peak in MFU, a run folder local to
each host, and SIGTERM to one host's torchrun agent stopping both hosts in one line each.

One run serves every check (the suite's time for multi-host runs is small). Host 0 may run on core 0
only and host 1 on both cores (taskset), and each host's CPU peak is put in the peak cache beforehand
(1 and 3 TFLOP/s, never reached, so no step corrects them): MFU must divide by 1 + 3 TFLOP/s, where
rank 0's machine times the world would say 2 x 1.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import time
from importlib import resources
from pathlib import Path

import pytest

from isthmus.config import build_config
from isthmus.launch.environ import spans_hosts
from isthmus.launch.hosts import EmulatedHosts, torchrun_argv
from isthmus.launch.rundir import lock_host_dir
from isthmus.models.flops import flops_per_token
from isthmus.models.resolve import resolve_model_args
from isthmus.profile import device
from isthmus.profile.device import PEAK_CACHE_FILE, cpu_peak_key

B = ["--config", "tiny", "--train.val_every", "0", "--train.batch_size", "8", "--train.seq_len", "32"]
B += ["--data.max_bytes", "60000", "--train.threads", "1", "--train.steps", "2000", "--metrics.log_every", "1"]
PEAKS = {"host0": (1, "0", 1e12), "host1": (2, "0,1", 3e12)}
"""host: (its cores, taskset's list, its peak)."""

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="emulated hosts need root (network, UTS and mount namespaces)"
)


def _seed_peaks(cache: Path) -> None:
    """Each host's peak under the key its rank looks up (`device.cpu_peak_key`: its hostname, its cores)."""
    entries = {}
    for host, (cores, _, flops) in PEAKS.items():
        digest = hashlib.sha256(f"{host}|{device._machine_id()}".encode()).hexdigest()[:12]
        machine = f"{device._cpu_model()} | {cores} cores | host {digest}"
        entries[cpu_peak_key("fp32", 1, machine=machine)] = {"flops": flops, "how": "probe"}
    cache.mkdir(parents=True, exist_ok=True)
    (cache / PEAK_CACHE_FILE).write_text(json.dumps(entries))


def _metrics(path: Path) -> list[dict[str, float]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if '"mfu"' in line]
    except (OSError, ValueError):
        return []


@needs_root
@pytest.mark.slow
def test_two_hosts_count_their_own_peaks_keep_local_folders_and_stop_together(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    run_dir = runs / "r"
    cache = tmp_path / "cache"
    _seed_peaks(cache)
    runs.mkdir()
    target = ["-m", "isthmus", "train", *B, "--train.run_dir", str(run_dir)]
    with EmulatedHosts(2) as hosts:
        procs = []
        for i, (_, cpus, _) in enumerate(PEAKS.values()):
            argv = ["taskset", "-c", cpus, *torchrun_argv(2, 1, "host0:29400", "hosts-failures", target)]
            if i == 1:  # host 1's own empty folder where host 0 has the run folder
                mount = 'mount -t tmpfs tmpfs "$0" && exec "$@"'
                argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", mount, str(runs), *argv]
            env = {"ISTHMUS_CACHE": str(cache), "ISTHMUS_REPROBE_PEAK": "0"}
            procs.append(hosts.popen(i, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + 120
        while len(_metrics(run_dir / "metrics.jsonl")) < 2 and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
            time.sleep(0.2)
        os.kill(procs[1].pid, signal.SIGTERM)  # host 1's torchrun agent (the commands above exec it)
        ends = [p.communicate(timeout=60) for p in procs]

    # Both hosts stopped, with 128 + SIGTERM, each in one line naming the host and rank that got it.
    for p, (_, err) in zip(procs, ends, strict=True):
        lines = [line for line in err.splitlines() if line.startswith("isthmus:")]
        assert p.returncode == 143, err
        assert len(lines) == 1, err
        assert lines[0].startswith("isthmus: interrupted (SIGTERM to rank 1 on host1) at step "), err
        assert "nothing to resume from (checkpoint.every = 0)" in lines[0]
    # MFU divided by both hosts' peaks, each host's own.
    assert (
        "MFU peak over 2 hosts: host0 1 rank(s) on 1 core(s), 1000.0 GFLOP/s; host1 1 rank(s) on 2 core(s), 3000.0 GFLOP/s"
        in ends[0][1]
    )
    cfg = build_config(resources.files("isthmus") / "configs" / "tiny.toml", [("train.seq_len", "32")])
    per_token = flops_per_token(resolve_model_args(cfg.model, 256), 32)
    records = _metrics(run_dir / "metrics.jsonl")
    assert len(records) >= 2
    for r in records:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * per_token / 4e12, rel=1e-9)
    # Host 1 had a folder of its own: its rank's log went there, not to host 0's.
    assert (run_dir / "logs" / "rank0.log").is_file() and not (run_dir / "logs" / "rank1.log").exists()


def test_a_hosts_own_folder_is_locked_against_a_second_job(tmp_path: Path) -> None:
    """Where a host does not share rank 0's folder, its local rank 0 locks its own (`lock_host_dir`)."""
    held = lock_host_dir(tmp_path / "run")
    try:
        with pytest.raises(
            Exception,
            match=rf"train.run_dir = '{tmp_path}/run': is in use by a live run \(pid {os.getpid()} on {socket.gethostname()}",
        ):
            lock_host_dir(tmp_path / "run")
    finally:
        held.release()
    lock_host_dir(tmp_path / "run").release()  # free once the job is gone


def test_spans_hosts_only_under_an_external_launch_over_several_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert not spans_hosts()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert spans_hosts()
