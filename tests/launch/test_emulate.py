"""The datacenter emulator: namespaces made and always removed, shaped WAN rate, gloo and torchrun across it.

These need root (ip netns, veth, tc), as CI has. They send traffic only inside namespaces they make.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from isthmus.errors import ConfigError
from isthmus.launch import netns
from isthmus.launch.emulate import EmulatedDatacenter, EmulatedNetwork, emulated_network, launch_emulated
from isthmus.launch.wanprobe import tcp_flows_bps


def _net(n_dc: int = 2, ranks: int = 1, wan_mbit: float = 20.0, **kw: object) -> EmulatedNetwork:
    return EmulatedNetwork([EmulatedDatacenter(f"dc{i}", ranks) for i in range(n_dc)], wan_mbit, **kw)  # type: ignore[arg-type]


def _links(namespace: str) -> str:
    return subprocess.run(
        ["ip", "-n", namespace, "-o", "link", "show"], capture_output=True, text=True, check=True
    ).stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has left its namespace


def test_namespaces_bridge_and_veths_exist_then_are_removed() -> None:
    with emulated_network(_net(3)) as em:
        names = netns.list_namespaces(em.prefix)
        assert sorted(names) == sorted(em.namespaces) and len(names) == 4
        bridge = _links(em.bridge_namespace)
        assert "br0" in bridge and all(f"dc{i}@" in bridge for i in range(3))
        for dc in em.dcs:
            assert f"{dc.ifname}@" in _links(dc.namespace)
            assert (
                "tbf"
                in subprocess.run(
                    ["tc", "-n", dc.namespace, "qdisc", "show", "dev", dc.ifname], capture_output=True, text=True
                ).stdout
            )
        assert len({dc.address for dc in em.dcs}) == 3
        # Inside a namespace every address of the run has a name without DNS (torch's store looks
        # its peers up); outside, the machine's own /etc/hosts is untouched.
        looked_up = subprocess.run(
            ["ip", "netns", "exec", em.dcs[0].namespace, "getent", "hosts", em.dcs[2].address],
            capture_output=True,
            text=True,
        )
        assert looked_up.stdout.split()[1:] == [em.dcs[2].namespace], looked_up
        assert em.prefix not in Path("/etc/hosts").read_text()
    assert netns.list_namespaces(em.prefix) == []
    assert not (netns.REGISTRY / em.run_id).exists()
    assert not any(netns.NETNS_ETC.glob(f"{em.prefix}*"))


def test_namespaces_removed_after_exception_inside() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with emulated_network(_net()) as em:
            sleeper = em.run_in(0, ["sleep", "30"])  # a child still inside a namespace must not keep it alive
            raise RuntimeError("boom")
    assert netns.list_namespaces(em.prefix) == []
    assert sleeper.returncode is not None


def test_interrupt_half_way_through_setup_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from isthmus.launch.emulate import network

    made: list[str] = []

    def interrupted_shape(net: EmulatedNetwork, dc: network.DatacenterNamespace, dcs: list) -> None:  # type: ignore[type-arg]
        made.append(dc.namespace)
        if dc.index == 1:  # dc0 is done, dc1's veth exists: Ctrl-C now
            raise KeyboardInterrupt

    monkeypatch.setattr(network, "_shape", interrupted_shape)
    with pytest.raises(KeyboardInterrupt):
        with emulated_network(_net(3)):
            pass
    prefix = made[0].rsplit("-", 1)[0] + "-"
    assert netns.list_namespaces(prefix) == []


_CHILD = textwrap.dedent("""
    import sys, time
    from isthmus.launch.emulate import EmulatedDatacenter, EmulatedNetwork, emulated_network
    net = EmulatedNetwork([EmulatedDatacenter("a", 1), EmulatedDatacenter("b", 1)], 20.0)
    with emulated_network(net) as em:
        sleeper = em.run_in(1, ["sleep", "60"])
        print(em.prefix, sleeper.pid, flush=True)
        time.sleep(60)
""")


def _start_child() -> tuple[subprocess.Popen[str], str, int]:
    """A process that owns an emulation with a `sleep` inside dc1: (process, run prefix, sleep's pid)."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline().split()
    assert line and line[0].startswith("ist-"), child.stderr.read() if child.stderr else ""
    assert len(netns.list_namespaces(line[0])) == 3
    return child, line[0], int(line[1])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_namespaces_removed_after_signal_to_owner(sig: signal.Signals) -> None:
    child, prefix, sleeper = _start_child()
    child.send_signal(sig)
    child.wait(timeout=20)
    assert child.returncode != 0
    assert netns.list_namespaces(prefix) == []
    assert not _alive(sleeper)


def _reaper_pid(prefix: str) -> int:
    """The pid of the reaper watching the run of ``prefix`` (``ist-<id>-``)."""
    run_id = prefix.split("-")[1]
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"isthmus.launch.reaper" in cmd and run_id.encode() in cmd:
            return int(proc.name)
    raise AssertionError(f"no reaper for {prefix}")


def _wait_until(check: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_reaper_removes_the_network_of_an_owner_killed_with_sigkill() -> None:
    child, prefix, sleeper = _start_child()
    reaper = _reaper_pid(prefix)
    assert os.getsid(reaper) == reaper  # its own session: a Ctrl-C at the terminal does not reach it
    child.kill()  # SIGKILL: the owner's own teardown cannot run
    child.wait(timeout=10)
    assert _wait_until(lambda: netns.list_namespaces(prefix) == [] and not _alive(sleeper), 15.0)
    assert _wait_until(lambda: not _alive(reaper), 5.0)
    assert not (netns.REGISTRY / prefix.split("-")[1]).exists()
    assert not any(netns.NETNS_ETC.glob(f"{prefix}*"))


def test_reaper_leaves_a_run_torn_down_by_its_owner_alone() -> None:
    with emulated_network(_net()) as em:
        reaper = _reaper_pid(em.prefix)
    assert not _alive(reaper)  # dismissed, and gone with the network
    assert not any(netns.NETNS_ETC.glob(f"{em.prefix}*"))


def test_cleanup_stale_removes_a_killed_run_but_not_a_live_one() -> None:
    child, prefix, sleeper = _start_child()
    os.kill(_reaper_pid(prefix), signal.SIGKILL)  # owner and reaper both gone (say, the OOM killer)
    child.kill()  # SIGKILL: no teardown can run
    child.wait(timeout=10)
    left = netns.list_namespaces(prefix)
    assert len(left) == 3
    with emulated_network(_net(), clean_stale=False) as live:
        removed = netns.cleanup_stale()
        assert set(left) <= set(removed)
        assert netns.list_namespaces(prefix) == []
        assert not _alive(sleeper)  # its namespace is really gone, not just unnamed
        assert len(netns.list_namespaces(live.prefix)) == 3  # a live run is left alone


def test_network_validation_names_the_key() -> None:
    with pytest.raises(ConfigError, match="emulate.wan_mbit"):
        _net(wan_mbit=0)
    with pytest.raises(ConfigError, match="wan_mbit_per_pair"):
        _net(wan_mbit_per_pair={(0, 5): 10.0})


@pytest.mark.slow
def test_shaped_wan_rate_within_20_percent_and_loopback_much_faster() -> None:
    with emulated_network(_net(wan_mbit=20.0)) as em:
        wan = tcp_flows_bps(em, 0, 1, n_bytes=5_000_000, warm_s=0.0, measure_s=10.0)
        local = tcp_flows_bps(em, 0, 0, n_bytes=50_000_000, warm_s=0.0, measure_s=10.0)
    print(f"dc0 -> dc1 {wan / 1e6:.2f} Mbit/s (configured 20), dc0 loopback {local / 1e6:.0f} Mbit/s")
    assert abs(wan - 20e6) <= 0.2 * 20e6, wan
    assert local > 20 * wan, (local, wan)


@pytest.mark.slow
def test_per_pair_rates_use_htb_classes() -> None:
    with emulated_network(_net(3, wan_mbit=40.0, wan_mbit_per_pair={(0, 2): 10.0})) as em:
        qdisc = subprocess.run(
            ["tc", "-n", em.dcs[0].namespace, "qdisc", "show", "dev", "wan0"], capture_output=True, text=True
        ).stdout
        assert "htb" in qdisc
        slow = tcp_flows_bps(em, 2, 0, n_bytes=2_000_000, warm_s=0.0, measure_s=8.0)  # (0, 2) also sets 2 -> 0
    assert abs(slow - 10e6) <= 0.2 * 10e6, slow


_ALL_REDUCE = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    rank, addr = int(sys.argv[1]), sys.argv[2]
    store = dist.TCPStore(addr, 29500, 2, is_master=rank == 0, timeout=__import__("datetime").timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    print(float(t[0]), flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_gloo_all_reduce_across_namespaces() -> None:
    with emulated_network(_net()) as em:
        dc0 = em.dcs[0].address
        procs = [
            em.run_in(
                i,
                [sys.executable, "-c", _ALL_REDUCE, str(i), dc0],
                env={"GLOO_SOCKET_IFNAME": em.dcs[i].ifname},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        outs = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert out.strip() == "3.0"


_RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    keys = ["RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "MASTER_ADDR", "GLOO_SOCKET_IFNAME",
            "ISTHMUS_DC_INDEX", "ISTHMUS_N_DC", "ISTHMUS_DC_RANKS", "ISTHMUS_DC_LAYOUT"]
    info = {k: os.environ.get(k) for k in keys} | {"sum": float(t[0])}
    (__import__("pathlib").Path(sys.argv[1]) / f"rank{dist.get_rank()}.json").write_text(json.dumps(info))
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_launch_emulated_torchrun_ranks_follow_datacenters(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(_RANK_SCRIPT)
    caplog.set_level(logging.INFO, logger="isthmus")
    rc = launch_emulated(_net(2, ranks=2), [str(tmp_path)], script=str(script), log_dir=tmp_path / "logs", timeout_s=90)
    assert rc == 0, "\n".join(p.read_text()[-2000:] for p in (tmp_path / "logs").glob("*.log"))
    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r, info in enumerate(infos):
        dc = r // 2
        assert info["ISTHMUS_DC_INDEX"] == info["GROUP_RANK"] == str(dc), info
        assert info["LOCAL_RANK"] == str(r % 2) and info["WORLD_SIZE"] == "4"
        assert info["MASTER_ADDR"] == "10.213.0.100" and info["GLOO_SOCKET_IFNAME"] == "wan0"
        assert info["ISTHMUS_N_DC"] == "2" and info["ISTHMUS_DC_RANKS"] == "2" and info["ISTHMUS_DC_LAYOUT"] == "2,2"
        assert info["sum"] == 6.0
    # The agents' output is clean: names for every address (no DNS warning from the store), and
    # the rendezvous store outlived both agents (no reset connection as the last one closed it).
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    assert "[W" not in logs and "Connection reset" not in logs and "Traceback" not in logs, logs[-3000:]
    # This run's namespaces are gone (another run on the machine may have its own meanwhile).
    prefix = re.search(r"in namespaces (ist-\w+)-\*", caplog.text)
    assert prefix, caplog.text
    assert not [n for n in netns.list_namespaces() if n.startswith(prefix.group(1) + "-")]


_FAIL_SCRIPT = textwrap.dedent("""
    import os, sys, time
    if os.environ["ISTHMUS_DC_INDEX"] == "1":
        sys.exit(3)
    time.sleep(120)  # dc0 would wait forever for its peer: the launcher must stop it
""")


@pytest.mark.slow
def test_launch_emulated_failure_stops_the_other_datacenters(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(_FAIL_SCRIPT)
    before = set(netns.list_namespaces())
    t0 = time.monotonic()
    rc = launch_emulated(_net(2), [], script=str(script), log_dir=tmp_path / "logs", timeout_s=60, grace_s=5)
    assert rc != 0 and rc != 124
    assert time.monotonic() - t0 < 40
    assert set(netns.list_namespaces()) <= before


_SLEEP_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    Path(sys.argv[1], f"pid{os.environ['ISTHMUS_DC_INDEX']}").write_text(str(os.getpid()))
    time.sleep(120)
""")

_LAUNCHER = textwrap.dedent("""
    import sys
    from isthmus.launch.emulate import EmulatedDatacenter, EmulatedNetwork, launch_emulated
    net = EmulatedNetwork([EmulatedDatacenter("a", 1), EmulatedDatacenter("b", 1)], 20.0)
    sys.exit(launch_emulated(net, [sys.argv[2]], script=sys.argv[1], log_dir=sys.argv[2], grace_s=5))
""")


@pytest.mark.slow
def test_ctrl_c_on_launch_emulated_stops_every_rank_and_removes_the_network(tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text(_SLEEP_SCRIPT)
    before = set(netns.list_namespaces())
    child = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(script), str(tmp_path)])
    pid_files = [tmp_path / "pid0", tmp_path / "pid1"]
    deadline = time.monotonic() + 60
    while not all(p.exists() and p.read_text() for p in pid_files):
        assert time.monotonic() < deadline and child.poll() is None, "ranks never started"
        time.sleep(0.1)
    assert len(set(netns.list_namespaces()) - before) == 3
    pids = [int(p.read_text()) for p in pid_files]
    child.send_signal(signal.SIGINT)
    assert child.wait(timeout=30) == 130
    assert not any(_alive(pid) for pid in pids)
    assert set(netns.list_namespaces()) <= before


def _probe_on_loopback(flows: int, n_bytes: int, warm_s: float, measure_s: float, send_s: float) -> dict[str, float]:
    """The TCP probe's two ends (as they run inside namespaces), here on the loopback, without root."""
    import threading

    from isthmus.launch import wanprobe

    srv = wanprobe.listen("127.0.0.1", 0, flows, 0)
    port = srv.getsockname()[1]
    sender = threading.Thread(target=wanprobe.source, args=("127.0.0.1", port, flows, 0, n_bytes, send_s))
    sender.start()
    try:
        return wanprobe.receive(srv, flows, n_bytes, warm_s, measure_s)
    finally:
        sender.join(timeout=30)
        srv.close()


def test_tcp_probe_times_a_bounded_transfer_from_its_first_chunk() -> None:
    result = _probe_on_loopback(flows=1, n_bytes=20_000_000, warm_s=0.0, measure_s=10.0, send_s=10.0)
    assert result["bytes"] == 20_000_000
    # The first chunk marks the start instant: every byte after it is counted, over the time they took.
    assert 0 < result["counted"] < 20_000_000 and result["seconds"] > 0, result


def test_tcp_probe_leaves_the_warm_up_out_and_counts_for_measure_s() -> None:
    result = _probe_on_loopback(flows=3, n_bytes=0, warm_s=0.3, measure_s=0.5, send_s=3.0)
    assert 0 < result["counted"] < result["bytes"], result
    assert 0.3 < result["seconds"] <= 0.6, result


def test_the_store_server_runs_as_a_module_and_says_ready() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "isthmus.launch.emulate.servers", "store", "127.0.0.1", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "ready"
    finally:
        server.terminate()
        _, err = server.communicate(timeout=30)
    assert err == ""  # no warning of runpy's or torch's on the way


def test_a_server_or_probe_end_that_does_not_exist_is_refused() -> None:
    from isthmus.launch import wanprobe
    from isthmus.launch.emulate import servers

    with pytest.raises(SystemExit, match="no server named 'nope'"):
        servers.main(["nope"])
    with pytest.raises(SystemExit, match="no probe end named 'nope'"):
        wanprobe.main(["nope"])
