"""examples/slurm/train.sbatch on a real Slurm: munged, slurmctld and two slurmd started here, each
slurmd on an emulated host (:mod:`isthmus.launch.hosts`), so the job's two nodes are two hosts with
their own addresses and hostnames, as on a cluster; and the script's own checks, with Slurm's
commands stood in for.

Everything the cluster needs is made in a temporary folder of its own (config, munge key and
socket, state, spool, logs), stopped and removed at the end; the daemons listen inside the hosts'
network namespaces, so Slurm's default ports cannot collide with anything on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

import isthmus
from isthmus.launch import netns
from isthmus.launch.hosts import EmulatedHosts
from procs import isthmus_argv

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "slurm" / "train.sbatch"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")

# The short run of both sides: 2 ranks of data parallelism, one per node under Slurm.
ARGS = [
    *("--config", "tiny", "--train.steps", "4", "--train.val_every", "0"),
    *("--train.batch_size", "8", "--train.seq_len", "32", "--data.max_bytes", "60000"),
    *("--parallel.dp_replicate", "2"),
]


def _slurm_missing() -> str | None:
    if os.geteuid() != 0:
        return "a Slurm cluster needs root (namespaces, slurmd)"
    absent = [d for d in DAEMONS if shutil.which(d) is None]
    return f"Slurm or munge is not installed ({', '.join(absent)}): apt-get install slurm-wlm munge" if absent else None


def _losses(path: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def _env(tmp: Path) -> dict[str, str]:
    """This interpreter's isthmus and torchrun first, as a user's activated virtual environment."""
    src = str(Path(isthmus.__file__).resolve().parents[1])
    return {
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        "PYTHONPATH": os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])]),
        "ISTHMUS_CACHE": str(tmp / "cache"),
    }


SLURM_CONF = """\
ClusterName=isthmus-test
SlurmctldHost={head}({head_addr})
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
PlugStackConfig={dir}/plugstack.conf
# No cgroups, accounting or MPI: only what srun + torchrun needs.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """munged (on this machine; its socket is a path every namespace sees), slurmctld on host 0, and
    a slurmd on each host, every daemon in the foreground as this process's child."""

    def __init__(self, hosts: EmulatedHosts, folder: Path, env: dict[str, str]) -> None:
        self.hosts, self.dir = hosts, folder
        self.conf = folder / "slurm.conf"
        self.env = {**env, "SLURM_CONF": str(self.conf)}
        self.daemons: list[subprocess.Popen[bytes]] = []
        self.log: IO[bytes] | None = None

    def on_host(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` on host ``i`` with /sys left as it is: slurmd 22.05 needs the cgroup hierarchy it
        finds there, which ``ip netns exec`` (the hosts' own way in) hides by mounting a fresh /sys.
        So: the host's network namespace, a mount namespace of its own with a hosts file over
        /etc/hosts (what ``ip netns exec`` does), and its hostname."""
        name = self.hosts.name(i)
        setup = f'mount --bind {self.dir}/hosts-{name} /etc/hosts && hostname {name} && exec "$@"'
        return [
            "nsenter",
            f"--net=/run/netns/{self.hosts.namespace(i)}",
            "unshare",
            "--mount",
            "--uts",
            "sh",
            "-c",
            setup,
            "sh",
            *argv,
        ]

    def start(self) -> None:
        d, hosts = self.dir, self.hosts
        for sub in ("state", *(f"spool/{hosts.name(i)}" for i in range(hosts.n))):
            (d / sub).mkdir(parents=True, exist_ok=True)
        (d / "plugstack.conf").touch()
        # The hosts' own hosts files, except that only the head node knows its name, as in a container
        # that knows only itself: the job must reach it by address.
        for i in range(hosts.n):
            lines = (netns.NETNS_ETC / hosts.namespace(i) / "hosts").read_text().splitlines()
            if i > 0:
                lines = [line for line in lines if line.split()[-1:] != [hosts.name(0)]]
            (d / f"hosts-{hosts.name(i)}").write_text("\n".join(lines) + "\n")
        # On a host with cgroup v2 alone, slurmd would ask systemd (over dbus) for a scope of its own;
        # there may be no systemd, and nothing here needs it (proctrack/linuxproc, task/none).
        (d / "cgroup.conf").write_text("CgroupPlugin=autodetect\nIgnoreSystemd=yes\n")
        (d / "munge.key").write_bytes(os.urandom(1024))
        (d / "munge.key").chmod(0o600)
        nodes = "\n".join(f"NodeName={hosts.name(i)} NodeAddr={hosts.address(i)} CPUs=1" for i in range(hosts.n))
        self.conf.write_text(SLURM_CONF.format(head=hosts.name(0), head_addr=hosts.address(0), dir=d, nodes=nodes))
        self.log = open(d / "daemons.log", "wb")  # noqa: SIM115 (the daemons' output, closed in stop)
        munge = [f"--socket={d}/munge.sock", f"--key-file={d}/munge.key", f"--pid-file={d}/munged.pid"]
        munge += [f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"]
        # --force: munged refuses to run as root otherwise.
        self._start(["munged", "--foreground", "--force", *munge])
        self._wait_for(d / "munge.sock", "munged")
        self._start(self.on_host(0, ["slurmctld", "-D", "-i", "-f", str(self.conf)]))
        for i in range(hosts.n):
            self._start(self.on_host(i, ["slurmd", "-D", "-f", str(self.conf), "-N", hosts.name(i)]))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            states = self.client("sinfo", "--noheader", "--format=%T").stdout.split()
            if states and all(s == "idle" for s in states) and len(states) == 1:
                return
            time.sleep(0.3)
        raise AssertionError(f"Slurm nodes not idle after 30 s: {states}\n{self.logs()}")

    def _start(self, argv: list[str]) -> None:
        self.daemons.append(subprocess.Popen(argv, stdout=self.log, stderr=self.log, env={**os.environ, **self.env}))

    def _wait_for(self, path: Path, what: str) -> None:
        deadline = time.monotonic() + 10
        while not path.exists():
            assert time.monotonic() < deadline, f"{what} did not start:\n{self.logs()}"
            time.sleep(0.05)

    def client(self, *argv: str) -> subprocess.CompletedProcess[str]:
        """A Slurm command run on host 0, as a user logged in there."""
        return subprocess.run(
            self.on_host(0, list(argv)), env={**os.environ, **self.env}, capture_output=True, text=True, timeout=30
        )

    def job_state(self, job: str) -> dict[str, str]:
        out = self.client("scontrol", "show", "job", "--oneliner", job).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait(self, job: str, timeout_s: float) -> dict[str, str]:
        """Wait for ``job`` to end; its final record."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.job_state(job)
            if state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return state
            time.sleep(0.3)
        raise AssertionError(
            f"job {job} still {self.job_state(job).get('JobState')} after {timeout_s} s\n{self.logs()}"
        )

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.dir.glob("*.log")))

    def stop(self) -> None:
        for proc in reversed(self.daemons):
            proc.terminate()
        for proc in reversed(self.daemons):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.log is not None:
            self.log.close()


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[SlurmCluster]:
    missing = _slurm_missing()
    if missing:
        pytest.skip(missing)
    # A short folder: munged's and slurmd's sockets live in it, and a socket's path has at most 107
    # bytes (pytest's tmp_path can be long).
    folder = Path(tempfile.mkdtemp(prefix="slurm-"))
    try:
        with EmulatedHosts(2) as hosts:
            cluster = SlurmCluster(hosts, folder, _env(tmp_path))
            try:
                cluster.start()
                yield cluster
            finally:
                cluster.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_sbatch_on_two_nodes_trains_as_isthmus_train(slurm: SlurmCluster, tmp_path: Path) -> None:
    def args(run: str) -> list[str]:
        return [*ARGS, "--train.run_dir", str(tmp_path / run), "--data.cache_dir", str(tmp_path / f"{run}-cache")]

    # Host 1 cannot resolve the head's name: the job must reach it by address alone.
    assert subprocess.run(slurm.on_host(1, ["getent", "hosts", "host0"]), capture_output=True).returncode == 2
    # The same run under `isthmus train`, beside the job: both mostly wait on their ranks' start-up.
    own = subprocess.Popen(
        isthmus_argv("train", *args("own"), "--parallel.nproc", "2"),
        env={**os.environ, **_env(tmp_path)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out = tmp_path / "job.out"
        batch = ["--nodes", "2", f"--chdir={tmp_path}", f"--output={out}", str(SCRIPT), *args("slurm-run")]
        submit = slurm.client("sbatch", "--parsable", *batch)
        assert submit.returncode == 0, submit.stderr
        state = slurm.wait(submit.stdout.strip().split(";")[0], timeout_s=180)
        _, own_err = own.communicate(timeout=180)
    finally:
        if own.poll() is None:  # the test failed first: stop the run and its ranks as a user would
            own.terminate()
            own.wait(timeout=30)
    assert own.returncode == 0, own_err[-3000:]
    log = out.read_text() if out.exists() else "(no output)"
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", f"{state}\n{log[-4000:]}"
    assert state["NodeList"] == "host[0-1]" and state["NumNodes"] == "2"
    assert log.count("isthmus train: done") == 1, log[-4000:]  # one world of 2 ranks, not 2 worlds of 1
    assert "layout dp_replicate=2 over 2 rank(s)" in log
    losses = _losses(tmp_path / "slurm-run" / "metrics.jsonl")
    assert len(losses) == 4
    assert losses == _losses(tmp_path / "own" / "metrics.jsonl")


def _script(tmp_path: Path, nodes: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """The batch script as Slurm runs it on the head node, with Slurm's commands and torchrun stood in
    for: scontrol lists ``nodes``, srun runs its command once (the task of the node SLURMD_NODENAME,
    the head unless ``env`` says), torchrun prints its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fakes = {
        "scontrol": "printf '%s\\n' " + " ".join(nodes),
        "srun": 'while [[ "$1" == --* ]]; do shift; done; exec "$@"',
        "torchrun": 'echo torchrun "$@"',
    }
    for tool, body in fakes.items():
        (bin_dir / tool).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / tool).chmod(0o755)
    slurm = {"SLURM_JOB_NODELIST": ",".join(nodes), "SLURM_JOB_NUM_NODES": str(len(nodes)), "SLURM_JOB_ID": "77"}
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "ISTHMUS_"))}
    return subprocess.run(
        ["bash", str(SCRIPT), "--train.steps", "5", "--parallel.tp", "2"],
        env={**keep, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **slurm, "SLURMD_NODENAME": nodes[0], **env},
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip


@pytest.mark.slow
def test_script_starts_one_torchrun_per_node_at_the_head_nodes_address(tmp_path: Path) -> None:
    proc = _script(tmp_path, ["localhost"], SLURM_GPUS_ON_NODE="4")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [
        *("torchrun", "--local-addr", "127.0.0.1", "--nnodes", "1", "--nproc-per-node", "4"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29500", "--rdzv-id", "77"),
        *("-m", "isthmus", "train", "--train.steps", "5", "--parallel.tp", "2"),
    ]
    # CPUs per task when there are no GPUs, and the overrides.
    cpu = _script(tmp_path, ["localhost"], SLURM_CPUS_PER_TASK="3", ISTHMUS_RDZV_PORT="29999").stdout
    assert "--nproc-per-node 3 " in cpu and "--rdzv-endpoint 127.0.0.1:29999 " in cpu
    assert "--nproc-per-node 2 " in _script(tmp_path, ["localhost"], ISTHMUS_NPROC_PER_NODE="2").stdout


@pytest.mark.slow
def test_script_stops_when_a_node_cannot_be_reached(tmp_path: Path) -> None:
    # A head node whose name resolves nowhere: one line, exit 1, and no torchrun started.
    unknown = _script(tmp_path, ["no-such-node.invalid", "node1.invalid"])
    assert unknown.returncode == 1 and unknown.stdout == ""
    assert unknown.stderr.splitlines() == [
        "train.sbatch: cannot resolve the node no-such-node.invalid to an IPv4 address (getent ahostsv4)"
    ]
    # Loopback on a job of 2 nodes: each node would reach only itself, a world of one that hangs.
    loop = _script(tmp_path, ["localhost", "node1.invalid"])
    assert loop.returncode == 1 and loop.stdout == ""
    assert loop.stderr.splitlines() == [
        "train.sbatch: the node localhost resolves to loopback 127.0.0.1, which other nodes cannot reach; fix /etc/hosts"
    ]
    # A node that cannot resolve its own name stops the same way before its torchrun starts.
    own = _script(tmp_path, ["localhost"], SLURMD_NODENAME="node1.invalid")
    assert own.returncode == 1 and own.stdout == ""
    assert own.stderr.splitlines() == [
        "train.sbatch: cannot resolve the node node1.invalid to an IPv4 address (getent ahostsv4)"
    ]
