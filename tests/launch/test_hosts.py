"""Emulated hosts (`isthmus.launch.hosts`): namespaces with their own addresses and hostnames, made
and always removed, and training runs across them as on real nodes, each equal to one process.

2 hosts, one torchrun per host meeting at host0:29400 (c10d), `-m isthmus train` on the tiny model
for the 5 steps of the equivalence matrix (tests/parallel/test_parallel_equivalence.py), held to its
tolerances: every step's loss and gradient norm within RTOL, final parameters within PARAM_RTOL.
The backend each group uses:

- dp_shard 2 x tp 2, 2 ranks per host (through `isthmus emulate --hosts 2`): tp inside each host
  through shared memory (`isthmus.parallel.shm_collectives`; its mapped file is seen), FSDP's
  gathers and reduce-scatters across the hosts through gloo.
- pp 2 x dp_replicate 2, 2 ranks per host: the pipeline's sends cross the hosts (gloo), the
  gradient all-reduce stays inside each host (gloo over its own address).
- tp 2, 1 rank per host: tp across the hosts through gloo; no shared memory, since the hosts'
  names differ.

And a single-host run (`isthmus train --parallel.nproc 2`) listens on loopback only, even on a
host with an address of its own.

These need root (ip netns, veth, unshare), as CI has; they send traffic only inside namespaces
they make. One set of hosts serves the whole module.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from isthmus.launch import netns
from isthmus.launch.hosts import EmulatedHosts, run_torchrun_job
from parallel.test_parallel_equivalence import BASE, PARAM_RTOL, RTOL, _train
from procs import isthmus_argv, needs_hosts, run_isthmus

pytestmark = [
    pytest.mark.slow,
    needs_hosts,
]


@pytest.fixture(scope="module")
def hosts() -> Iterator[EmulatedHosts]:
    with EmulatedHosts(2) as h:
        yield h
    assert netns.list_namespaces(h.prefix) == []


def test_each_host_has_its_name_and_every_name_resolves_to_its_address(hosts: EmulatedHosts) -> None:
    probe = "import socket; print(socket.gethostname(), socket.gethostbyname('host0'), socket.gethostbyname('host1'))"
    for i in range(2):
        out = hosts.run(i, [sys.executable, "-c", probe])
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [f"host{i}", hosts.address(0), hosts.address(1)]
    assert hosts.name(1) == "host1" and hosts.address(0) != hosts.address(1)
    # Outside, nothing changed: the machine's name and /etc/hosts are its own.
    assert "host1" not in Path("/etc/hosts").read_text()


def test_a_host_reaches_another_by_name(hosts: EmulatedHosts) -> None:
    server = hosts.popen(
        1,
        [
            sys.executable,
            "-c",
            "import socket; s = socket.create_server(('host1', 7000)); c, a = s.accept(); c.sendall(a[0].encode())",
        ],
    )
    client = "import socket, time\nfor _ in range(100):\n  try: print(socket.create_connection(('host1', 7000)).recv(64).decode()); break\n  except OSError: time.sleep(0.05)"
    out = hosts.run(0, [sys.executable, "-c", client])
    assert out.stdout.strip().endswith(hosts.address(0)), out  # host 1 saw host 0's own address
    assert server.wait(timeout=10) == 0


def test_kill_stops_everything_on_one_host_and_nothing_else(hosts: EmulatedHosts) -> None:
    dying = hosts.popen(1, ["sleep", "60"])
    living = hosts.popen(0, ["sleep", "60"])
    deadline = time.monotonic() + 10
    while dying.pid not in hosts.pids(1) and time.monotonic() < deadline:  # `ip netns exec` execs: same pid
        time.sleep(0.05)
    killed = hosts.kill(1)
    assert dying.wait(timeout=10) == -signal.SIGKILL and dying.pid in killed
    assert hosts.pids(1) == [] and living.poll() is None
    living.kill()
    living.wait()


def test_hosts_are_removed_after_an_exception_with_a_process_still_running() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedHosts(3) as h:
            sleeper = h.popen(2, ["sleep", "60"])
            assert len(netns.list_namespaces(h.prefix)) == 4  # 3 hosts and the bridge's
            raise RuntimeError("boom")
    assert netns.list_namespaces(h.prefix) == []
    assert sleeper.returncode is not None
    assert not any(netns.NETNS_ETC.glob(f"{h.prefix}*")) and not (netns.REGISTRY / h.run_id).exists()


# --- training across hosts, each equal to one process ---------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hosts")


Reference = tuple[list[float], list[float], dict[str, torch.Tensor]]
"""The single-process run's losses, gradient norms and final parameters."""


@pytest.fixture(scope="module")
def reference(workdir: Path) -> Reference:
    """The single-process run every layout is held to (losses, gradient norms, final parameters)."""
    losses, norms = _train([], str(workdir / "single"), str(workdir / "cache"))
    return losses, norms, torch.load(workdir / "single" / "final" / "model.pt", weights_only=True)


def _train_args(workdir: Path, name: str, overrides: list[str]) -> list[str]:
    return [
        "train",
        *BASE,
        *overrides,
        "--train.run_dir",
        str(workdir / name),
        "--data.cache_dir",
        str(workdir / "cache"),
    ]


def _assert_equals_one_process(run: Path, reference: Reference) -> None:
    ref_losses, ref_norms, ref_params = reference
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, len(ref_losses) + 1))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in steps]), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    torch.testing.assert_close(
        torch.tensor([r["grad_norm"] for r in steps]), torch.tensor(ref_norms), rtol=RTOL, atol=0
    )
    params = torch.load(run / "final" / "model.pt", weights_only=True)
    assert params.keys() == ref_params.keys()
    for key, ref in ref_params.items():
        rel = float((params[key] - ref).norm() / ref.norm())
        assert rel < PARAM_RTOL, f"{run.name}: {key} differs by {rel:.2e} (relative norm)"


class SharedMemoryWatch:
    """Which emulated hosts' processes map a tensor-parallel shared-memory file, sampled while a run goes
    on (the file is unlinked once every rank has mapped it, but stays mapped for the whole run)."""

    def __init__(self) -> None:
        self._seen: dict[str, set[str]] = {}  # namespace -> files
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> SharedMemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def of_run(self, prefix: str) -> dict[str, set[str]]:
        """The files seen on each host (``host0``, ...) of the run whose namespaces start with ``prefix``
        (other tests' hosts may run beside these)."""
        return {ns[len(prefix) :]: files for ns, files in self._seen.items() if ns.startswith(prefix)}

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            for name in netns.list_namespaces():
                for pid in netns.namespace_pids(name):
                    try:
                        maps = Path(f"/proc/{pid}/maps").read_text()
                    except OSError:
                        continue
                    files = set(re.findall(r"/dev/shm/isthmus-allreduce-[0-9a-f]+", maps))
                    if files:
                        self._seen.setdefault(name, set()).update(files)


def test_cli_fsdp_across_hosts_tp_inside_equals_one_process(workdir: Path, reference: Reference) -> None:
    train = _train_args(workdir, "fsdp_tp", ["--parallel.dp_shard", "2", "--parallel.tp", "2"])
    with SharedMemoryWatch() as shm:
        done = run_isthmus("emulate", "--hosts", "2", "--nproc-per-node", "2", "--", *train, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("host0| ") and "isthmus train: done" in line for line in lines), done.stdout
    assert "Traceback" not in done.stdout + done.stderr
    _assert_equals_one_process(workdir / "fsdp_tp", reference)
    # tp inside each host through shared memory: one file per host, mapped by both of its ranks.
    prefix = re.search(r"in namespaces (ist-[0-9a-f]{6}-)\*", done.stdout + done.stderr)
    assert prefix, done.stderr
    seen = shm.of_run(prefix.group(1))
    assert sorted(seen) == ["host0", "host1"] and all(len(f) == 1 for f in seen.values()), seen
    assert seen["host0"] != seen["host1"]


def test_pp_across_hosts_dp_inside_equals_one_process(
    hosts: EmulatedHosts,
    workdir: Path,
    reference: Reference,
) -> None:
    overrides = ["--parallel.pp", "2", "--parallel.pp_schedule", "gpipe", "--parallel.microbatches", "2"]
    train = _train_args(workdir, "pp_dp", [*overrides, "--parallel.dp_replicate", "2"])
    end = run_torchrun_job(hosts, 2, ["-m", "isthmus", *train], timeout_s=240)
    assert end.code == 0, end
    _assert_equals_one_process(workdir / "pp_dp", reference)


def test_tp_across_hosts_equals_one_process_through_gloo(
    hosts: EmulatedHosts,
    workdir: Path,
    reference: Reference,
) -> None:
    train = _train_args(workdir, "tp_across", ["--parallel.tp", "2"])
    with SharedMemoryWatch() as shm:
        end = run_torchrun_job(hosts, 1, ["-m", "isthmus", *train], timeout_s=240)
    assert end.code == 0, end
    _assert_equals_one_process(workdir / "tp_across", reference)
    assert shm.of_run(hosts.prefix) == {}  # the hosts' names differ: no shared memory between them, gloo carries tp


def _listeners(pid: int, namespace: str) -> set[str]:
    """``address:port`` of every TCP socket listening in ``pid``'s network namespace (IPv4 and IPv6),
    once ``pid`` has entered ``namespace`` (before, it is still in the machine's own)."""
    found: set[str] = set()
    try:
        if os.stat(f"/proc/{pid}/ns/net").st_ino != os.stat(f"/run/netns/{namespace}").st_ino:
            return found
    except OSError:
        return found
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            if state == "0A":  # LISTEN
                address, port = local.split(":")
                found.add(f"{_address(address)}:{int(port, 16)}")
    return found


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    # /proc/net/tcp* hold each 32-bit word in host (little-endian) order.
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def test_single_host_run_listens_on_loopback_only(hosts: EmulatedHosts, workdir: Path) -> None:
    """On a host with an address of its own, `isthmus train` with 2 ranks listens on 127.0.0.1 only:
    nothing on 0.0.0.0, ::, or the host's address (sampled from its network namespace throughout)."""
    args = _train_args(workdir, "single_host", ["--parallel.nproc", "2"])
    proc = hosts.popen(0, isthmus_argv(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: set[str] = set()
    while proc.poll() is None:
        seen |= _listeners(proc.pid, hosts.namespace(0))
        time.sleep(0.05)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    assert seen and all(s.startswith("127.0.0.1:") for s in seen), seen
