"""WAN latency in the emulator (the user-space delay line): real namespaces, real packets.

- ICMP echo between two datacenters takes the configured RTT (within 10%) at 20 and 80 ms.
- At 80 ms RTT on a 100 Mbit/s link, one TCP flow with 64 KiB socket buffers is window-bound
  (window / RTT, far under the link) while 8 such flows together get several times more.
- The forwarder is gone with the network: after a normal exit and after SIGKILL of the owner.

These need root (ip netns, tuntap, tc), as CI has; their traffic stays inside the namespaces they make.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from isthmus.cli import main
from isthmus.cli.emulate import emulated_network_of
from isthmus.errors import ConfigError
from isthmus.launch import netns
from isthmus.launch.emulate import EmulatedDatacenter, EmulatedNetwork, emulated_network
from isthmus.launch.wanprobe import ping_ms, tcp_flows_bps
from isthmus.planner.topology import load_topology
from procs import run_isthmus

pytestmark = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or not Path("/dev/net/tun").exists(),
    reason="needs root and /dev/net/tun (network namespaces, TUN devices)",
)


def _net(rtt_ms: float, wan_mbit: float = 100.0, **kw: object) -> EmulatedNetwork:
    return EmulatedNetwork(
        [EmulatedDatacenter("dc0", 1), EmulatedDatacenter("dc1", 1)],
        wan_mbit,
        wan_rtt_ms=rtt_ms,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("rtt_ms", [20.0, 80.0])
@pytest.mark.slow
def test_ping_rtt_within_10_percent_of_the_setting(rtt_ms: float) -> None:
    with emulated_network(_net(rtt_ms)) as em:
        there = ping_ms(em, 0, 1, count=7, interval_s=0.15)
        back = ping_ms(em, 1, 0, count=7, interval_s=0.15)
    print(f"RTT {rtt_ms:g} ms: dc0 -> dc1 {there}, dc1 -> dc0 {back}")
    for rtts in (there, back):
        assert abs(statistics.median(rtts) - rtt_ms) <= 0.1 * rtt_ms, rtts


@pytest.mark.slow
def test_one_flow_is_window_bound_and_several_flows_recover_the_link() -> None:
    # The emulator's window limit (emulate --wan-window-kib), sockets left to the kernel: what gloo sees.
    with emulated_network(_net(80.0, wan_mbit=100.0, wan_window_kib=64)) as em:
        one = tcp_flows_bps(em, 0, 1, flows=1) / 1e6
        eight = tcp_flows_bps(em, 0, 1, flows=8) / 1e6
    print(f"80 ms RTT, 100 Mbit/s, 64 KiB windows: 1 flow {one:.1f} Mbit/s, 8 flows {eight:.1f} Mbit/s")
    assert one < 30.0, one  # window / RTT: a few Mbit/s, far under the link
    assert eight > 3 * one, (one, eight)
    assert eight <= 105.0, eight  # and the link's rate still holds


def _forwarders(run_id: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"isthmus.launch.delayline" in cmd and f"ist-{run_id}-".encode() in cmd:
            pids.append(int(proc.name))
    return pids


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_teardown_leaves_no_namespace_and_no_forwarder() -> None:
    with emulated_network(_net(20.0)) as em:
        forwarders = _forwarders(em.run_id)
        assert len(forwarders) == 1
        assert forwarders[0] in netns.namespace_pids(em.bridge_namespace)  # the -wan namespace's: reaped with it
    assert netns.list_namespaces(em.prefix) == []
    assert not any(_alive(p) for p in forwarders)


_OWNER = textwrap.dedent("""
    import time
    from isthmus.launch.emulate import EmulatedDatacenter, EmulatedNetwork, emulated_network
    net = EmulatedNetwork([EmulatedDatacenter("a", 1), EmulatedDatacenter("b", 1)], 20.0, wan_rtt_ms=40.0)
    with emulated_network(net) as em:
        print(em.run_id, flush=True)
        time.sleep(60)
""")


def test_sigkill_of_the_owner_leaves_no_namespace_and_no_forwarder() -> None:
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    run_id = owner.stdout.readline().strip()
    forwarders = _forwarders(run_id)
    assert len(forwarders) == 1
    owner.send_signal(signal.SIGKILL)
    owner.wait(timeout=10)
    deadline = time.monotonic() + 15
    while (netns.list_namespaces(f"ist-{run_id}-") or any(map(_alive, forwarders))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert netns.list_namespaces(f"ist-{run_id}-") == []
    assert not any(_alive(p) for p in forwarders)


def test_rtt_zero_makes_no_delay_line() -> None:
    with emulated_network(_net(0.0)) as em:
        assert _forwarders(em.run_id) == []
        links = subprocess.run(["ip", "-n", em.dcs[0].namespace, "-o", "link"], capture_output=True, text=True).stdout
        assert "wan1" not in links


def test_rtt_validation_names_the_key() -> None:
    with pytest.raises(ConfigError, match="emulate.wan_rtt_ms = -1"):
        _net(-1.0)
    with pytest.raises(ConfigError, match=r"wan_rtt_ms_per_pair\[0,1\]"):
        _net(10.0, wan_rtt_ms_per_pair={(0, 1): -5.0})


_THREE_DC = """
name = "three"
[[datacenters]]
name = "a"
device = "cpu"
nodes = 1
devices_per_node = 1
intra_node = { bandwidth_gb_s = 1, latency_us = 1 }
fabric = { bandwidth_gb_s = 1, latency_us = 1 }
[[datacenters]]
name = "b"
device = "cpu"
nodes = 1
devices_per_node = 1
intra_node = { bandwidth_gb_s = 1, latency_us = 1 }
fabric = { bandwidth_gb_s = 1, latency_us = 1 }
[[datacenters]]
name = "c"
device = "cpu"
nodes = 1
devices_per_node = 1
intra_node = { bandwidth_gb_s = 1, latency_us = 1 }
fabric = { bandwidth_gb_s = 1, latency_us = 1 }
[[wan]]
between = ["a", "b"]
bandwidth_gb_s = 0.0125
latency_us = 5000
[[wan]]
between = ["a", "c"]
bandwidth_gb_s = 0.0125
latency_us = 20000
[[wan]]
between = ["b", "c"]
bandwidth_gb_s = 0.0125
latency_us = 20000
"""


@pytest.mark.slow
def test_the_topologys_one_way_latency_is_half_of_each_links_rtt(tmp_path: Path) -> None:
    path = tmp_path / "three.toml"
    path.write_text(_THREE_DC)
    net = emulated_network_of(load_topology(str(path)), str(path))
    assert (net.wan_mbit, net.rtt_ms(0, 1), net.rtt_ms(1, 0), net.rtt_ms(0, 2), net.rtt_ms(2, 1)) == (
        100.0,
        10.0,
        10.0,
        40.0,
        40.0,
    )
    flat = emulated_network_of(load_topology(str(path)), str(path), wan_rtt_ms=30.0)
    assert {flat.rtt_ms(i, j) for i in range(3) for j in range(3) if i != j} == {30.0}
    assert not emulated_network_of(load_topology("emulated-2dc"), "emulated-2dc").delayed  # RTT 0: today's path
    with emulated_network(net) as em:
        near, far = ping_ms(em, 0, 1, count=7, interval_s=0.15), ping_ms(em, 2, 1, count=7, interval_s=0.15)
    print(f"per-pair RTT: a <-> b {near} (10 ms), c <-> b {far} (40 ms)")
    # The fastest ping: netem's delay is a floor that scheduling on a busy machine only adds to (a
    # CI run saw a median of 12.0 ms over 10.5-25.8 ms for the 10 ms pair); a wrong delay moves it.
    assert 9.5 <= min(near) <= 11.0, near
    assert 38.0 <= min(far) <= 44.0, far


def test_a_negative_wan_rtt_flag_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["emulate", "--wan-rtt-ms", "-20", "--", "train", "--config", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "isthmus: error: --wan-rtt-ms = -20.0: must be between 0 and 10000 ms", err
    assert main(["emulate", "--wan-window-kib", "4", "--", "train", "--config", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "isthmus: error: --wan-window-kib = 4: must be 0 (autotuned) or between 16 and 65536 KiB"


@pytest.mark.slow
def test_emulate_cli_trains_through_the_delayed_wan(tmp_path: Path) -> None:
    """torchrun's rendezvous and gloo connect through the delay line: a short run succeeds at 80 ms."""
    argv = ["emulate", "--wan-rtt-ms", "80", "--topology", "emulated-2dc", "--", "train", "--config", "tiny"]
    argv += ["--train.steps", "2", "--train.val_every", "0", "--train.run_dir", str(tmp_path / "run")]
    argv += ["--metrics.progress", "false"]
    run = run_isthmus(*argv)
    console = run.stdout + run.stderr
    assert run.returncode == 0, console[-3000:]
    assert "RTT 80 ms (user-space delay line)" in console
    assert "isthmus train: done" in console
    assert "Traceback" not in console
    prefix = re.search(r"namespaces (ist-[0-9a-f]{6}-)\*", console)
    assert prefix is not None, console[-3000:]
    assert netns.list_namespaces(prefix[1]) == []  # its network is gone
