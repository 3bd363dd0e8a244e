"""The real launchers: `isthmus train --parallel.nproc N` (elastic launch) and an external torchrun."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from multirank import free_port
from procs import isthmus_argv, run_isthmus

ARGS = [
    "--config",
    "tiny",
    "--train.steps",
    "6",
    "--train.val_every",
    "3",
    "--data.max_bytes",
    "200000",
    "--parallel.dp_replicate",
    "2",
]


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "ISTHMUS_CACHE": str(tmp_path / "cache")}


def _two_ranks(tmp_path: Path, run: str = "r") -> list[str]:
    """`isthmus train` arguments of the short run on 2 local ranks, in ``tmp_path``."""
    return [
        *ARGS,
        "--parallel.nproc",
        "2",
        "--train.run_dir",
        str(tmp_path / run),
        "--data.cache_dir",
        str(tmp_path / "cache"),
    ]


def _losses(path: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


@pytest.mark.slow
def test_nproc_launch_and_torchrun_train_identically(tmp_path: Path) -> None:
    own = run_isthmus("train", *_two_ranks(tmp_path, "own"), env=_env(tmp_path))
    assert own.returncode == 0, own.stderr[-3000:]
    assert "on 2 rank(s)" in own.stdout
    # Rank 0 alone drives the console; every rank has its own log file.
    assert own.stderr.count("step 6/6") == 1, own.stderr
    logs = tmp_path / "own" / "logs"
    assert (logs / "rank0.log").is_file() and "step 6/6" in (logs / "rank0.log").read_text()
    assert (logs / "rank1.log").is_file() and "layout dp_replicate=2 over 2 rank(s)" in (logs / "rank1.log").read_text()

    port = free_port()
    ext = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "-m",
            "isthmus",
            "train",
            *ARGS,
            "--train.run_dir",
            str(tmp_path / "ext"),
            "--data.cache_dir",
            str(tmp_path / "cache"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(tmp_path),
    )
    assert ext.returncode == 0, ext.stderr[-3000:]
    assert ext.stdout.count("isthmus train: done") == 1  # only rank 0 prints the summary
    own_losses = _losses(tmp_path / "own" / "metrics.jsonl")
    assert own_losses == _losses(tmp_path / "ext" / "metrics.jsonl")
    assert len(own_losses) == 6 and own_losses[-1] < own_losses[0]


@pytest.mark.slow
def test_torchrun_world_size_must_match_nproc(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "-m",
            "isthmus",
            "train",
            *ARGS,
            "--parallel.nproc",
            "4",
            "--train.run_dir",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(tmp_path),
    )
    assert proc.returncode != 0
    assert "isthmus: error: parallel.nproc = 4" in proc.stderr
    # Each rank stops with our one line before training; torchrun then reports the failed ranks itself.
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_user_error_inside_ranks_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "ck" / "step-000002"
    bad.mkdir(parents=True)
    (bad / "isthmus.json").write_text("not json")
    proc = run_isthmus("train", *_two_ranks(tmp_path), "--checkpoint.resume", str(bad), env=_env(tmp_path))
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert errors == [
        f"isthmus: error: {bad / 'isthmus.json'}: not a valid checkpoint manifest "
        "(JSONDecodeError: Expecting value: line 1 column 1 (char 0)) (rank0)"
    ], proc.stderr


def _process_tree(root: int) -> set[int]:
    """``root`` and every process below it (the agent, its spawned ranks, their helpers)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name may hold spaces and parentheses: the fields after the last ')' are fixed.
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a process that ended while we looked
    tree, grown = {root}, True
    while grown:
        below = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= below
        grown = bool(below)
    return tree


def _proc_address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address of /proc/net/tcp{,6}: 32-bit words, each in the kernel's (little-endian) byte order."""
    raw = bytes.fromhex(hex_addr)
    return ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))


def _listening(pids: set[int]) -> list[tuple[int, str, bool]]:
    """(pid, address:port, on loopback) of every listening TCP socket the processes ``pids`` hold."""
    found = []
    for pid in pids:
        try:
            inodes = {
                os.readlink(fd)[8:-1]
                for fd in Path(f"/proc/{pid}/fd").iterdir()
                if os.readlink(fd).startswith("socket:[")
            }
            tables = [Path(f"/proc/{pid}/net/{t}").read_text().splitlines()[1:] for t in ("tcp", "tcp6")]
        except OSError:
            continue
        for line in (row for table in tables for row in table):
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: TCP_LISTEN
                addr_hex, port_hex = local.split(":")
                addr = _proc_address(addr_hex)
                mapped = getattr(addr, "ipv4_mapped", None)
                found.append((pid, f"{addr}:{int(port_hex, 16)}", (mapped or addr).is_loopback))
    return found


@pytest.mark.slow
def test_local_ranks_listen_on_loopback_only(tmp_path: Path) -> None:
    """The agent's rendezvous store, rank 0's store and gloo: every listening socket of the run is on loopback."""
    run = tmp_path / "r"
    proc = subprocess.Popen(
        isthmus_argv("train", *_two_ranks(tmp_path), "--train.steps", "100000", "--train.val_every", "0"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(tmp_path),
    )
    try:
        deadline = time.monotonic() + 240
        while not ((run / "metrics.jsonl").is_file() and len((run / "metrics.jsonl").read_text().splitlines()) >= 3):
            assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.5)
        tree = _process_tree(proc.pid)
        sockets = _listening(tree)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # The agent (rendezvous store), rank 0 (the ranks' store) and both ranks (gloo) listen: 3 at least.
    assert len({pid for pid, _, _ in sockets}) == 3 and len(sockets) >= 4, sockets
    assert all(loopback for _, _, loopback in sockets), [s for s in sockets if not s[2]]


@pytest.mark.slow
def test_local_ranks_train_when_the_hostname_resolves_nowhere(tmp_path: Path) -> None:
    """A host whose name does not resolve: the run still trains (it used to wait 5 minutes on the name).

    The name is changed in a UTS namespace of the test's own (root, as the emulator tests need).
    """
    name = "isthmus-unresolvable-host"
    try:
        socket.getaddrinfo(name, None)
        raise AssertionError(f"{name} resolves here; the test needs a name that does not")
    except socket.gaierror:
        pass
    proc = subprocess.run(
        [
            "unshare",
            "--uts",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            name,
            *isthmus_argv("train", *_two_ranks(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=150,
        env=_env(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(_losses(tmp_path / "r" / "metrics.jsonl")) == 6


def test_only_this_user_can_ask_the_rank_server_to_fork() -> None:
    """The server the ranks fork from (isthmus.launch.warm) runs whatever a client sends it: its socket
    must be a file only this user can open, not a name in Linux's abstract namespace (any local user)."""
    code = (
        "import multiprocessing.forkserver as f, os, stat, json; "
        "from isthmus.launch.warm import start_rank_server; "
        "start_rank_server(()); a = f._forkserver._forkserver_address; "
        "print(json.dumps([a, stat.S_IMODE(os.stat(a).st_mode), stat.S_IMODE(os.stat(os.path.dirname(a)).st_mode)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    address, mode, folder = json.loads(out)
    assert isinstance(address, str) and not address.startswith("\0"), address
    assert mode == 0o600 and folder == 0o700, (oct(mode), oct(folder))
