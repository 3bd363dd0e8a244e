"""Emulated hosts (`isthmus.launch.hosts`): namespaces with their own addresses and hostnames, made
and always removed, and a run across them as on real nodes.

These need root (ip netns, veth, unshare), as CI has; they send traffic only inside namespaces
they make. One set of hosts serves the whole module.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from isthmus.launch import netns
from isthmus.launch.hosts import EmulatedHosts

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not hasattr(os, "geteuid")
        or os.geteuid() != 0
        or shutil.which("ip") is None
        or shutil.which("unshare") is None,
        reason="emulated hosts need root, iproute2 and unshare",
    ),
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
