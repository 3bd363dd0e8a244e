"""Linux network namespaces for the datacenter emulator: make, enter, empty and remove them.

Every name this module makes starts with a per-run prefix ``ist-<6 hex>-``, so two runs never
collide and a crashed run's leftovers can be found by name. A run registers its owner process in
``/run/isthmus-emulate/<run id>``; :func:`cleanup_stale` removes only namespaces whose owner is
gone (or all of a prefix, when asked). Nothing here touches the root namespace's interfaces,
routes or qdiscs: interfaces are created directly inside namespaces made here (``ip -n NS``).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

from isthmus.errors import IsthmusError
from isthmus.log import get_logger

PREFIX = "ist-"
"""Every namespace the emulator makes starts with this."""

REGISTRY = Path("/run/isthmus-emulate")
"""One file per live run: the owner's pid and start time, so stale runs can be told from live ones."""

NETNS_ETC = Path("/etc/netns")
"""``ip netns exec NS`` bind-mounts the files of ``/etc/netns/NS/`` over those of ``/etc``."""

SHM = Path("/dev/shm")
"""Shared by every namespace: what a run's processes leave here outlives its namespaces."""

_RUN_RE = re.compile(r"^ist-([0-9a-f]{6})-")


def new_run_id() -> str:
    """Six hex digits naming one emulation run (namespaces are ``ist-<id>-...``)."""
    return secrets.token_hex(3)


def run_prefix(run_id: str) -> str:
    return f"{PREFIX}{run_id}-"


def require_root() -> None:
    """Fail with one line unless this process can make namespaces and qdiscs."""
    if os.geteuid() != 0:
        raise IsthmusError("isthmus emulate needs root (ip netns, veth, tc): run it as root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise IsthmusError(f"isthmus emulate needs `{tool}` (iproute2) on PATH")


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one iproute2 command; a failure names the command and its stderr."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """Names of the network namespaces that start with ``prefix``."""
    out = sh("ip", "netns", "list", check=False).stdout
    # `ip netns list` prints "name" or "name (id: N)".
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def add_namespace(name: str) -> None:
    """Make namespace ``name`` with ``lo`` up."""
    sh("ip", "netns", "add", name)
    sh("ip", "-n", name, "link", "set", "lo", "up")


def write_hosts(name: str, names: dict[str, str]) -> None:
    """Give processes started in namespace ``name`` (by ``ip netns exec``) a hosts file with ``names``
    (IPv4 address -> host name).

    Without it, torch's TCPStore looks up every connecting peer's address in DNS, which no
    namespace here can reach, and warns once per connection ("The hostname of the client socket
    cannot be retrieved"). The machine's own /etc/hosts comes first, so nothing it names changes.
    """
    base = Path("/etc/hosts").read_text() if Path("/etc/hosts").is_file() else "127.0.0.1 localhost\n"
    # Twice: torch's store listens on a dual-stack socket, where an IPv4 peer shows as ::ffff:a.b.c.d.
    ours = "".join(f"{address} {host}\n::ffff:{address} {host}\n" for address, host in names.items())
    folder = NETNS_ETC / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hosts").write_text(base.rstrip("\n") + "\n# isthmus emulate\n" + ours)


def namespace_pids(name: str) -> list[int]:
    out = sh("ip", "netns", "pids", name, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def kill_namespace_processes(name: str, grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL, every process still inside namespace ``name``.

    Only processes in a namespace this emulator made can be here, so they are ours; while any
    lives, deleting the name would leave the namespace (and its veths) alive behind it.
    """
    _kill(namespace_pids(name), grace_s)


def _kill(pids: list[int], grace_s: float) -> None:
    """SIGTERM ``pids``, then SIGKILL those alive after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            if pids:
                time.sleep(0.05)
        if not pids:
            return


def delete_namespace(name: str) -> None:
    """Empty and remove namespace ``name``; removing it removes its veths and their qdiscs."""
    kill_namespace_processes(name)
    proc = sh("ip", "netns", "del", name, check=False)
    if proc.returncode != 0 and name in list_namespaces(name):
        get_logger().warning("could not remove network namespace %s: %s", name, proc.stderr.strip())
    _remove_etc(name)


def _remove_etc(name: str) -> None:
    """Remove ``/etc/netns/<name>`` (our hosts file), and ``/etc/netns`` itself once empty."""
    assert name.startswith(PREFIX), name
    shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
    try:
        NETNS_ETC.rmdir()  # only when empty: another tool's files there stay
    except OSError:
        pass


def shared_memory_files(prefix: str) -> set[Path]:
    """The files in /dev/shm that processes in the namespaces of ``prefix`` have mapped or open
    (multiprocessing's named semaphores, shared buffers). Only the run's processes run there, so
    once they are gone nothing else uses these files."""
    files: set[Path] = set()
    for pid in (p for name in list_namespaces(prefix) for p in namespace_pids(name)):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
            fds = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:  # it ended meanwhile
            continue
        mapped = [fields[5] for line in maps if len(fields := line.split(maxsplit=5)) == 6]
        files |= {Path(f) for f in mapped + fds if f.startswith(f"{SHM}/") and not f.endswith(" (deleted)")}
    return files


def delete_prefix(prefix: str, shm: set[Path] | frozenset[Path] = frozenset()) -> list[str]:
    """Remove every namespace whose name starts with ``prefix`` (datacenters first, bridge last), and
    then the files in /dev/shm its processes held (:func:`shared_memory_files`, with ``shm``: those
    noted before some of them were stopped)."""
    assert prefix.startswith(PREFIX), prefix
    names = list_namespaces(prefix)
    files = shm | shared_memory_files(prefix)
    # Every namespace's processes at once: one grace period for the run, not one per namespace.
    _kill([pid for name in names for pid in namespace_pids(name)], grace_s=2.0)
    # The bridge namespace goes last: each DC's veth peer lives in it until that DC is gone.
    for name in sorted(names, key=lambda n: n.endswith("-wan")):
        delete_namespace(name)
    for f in files:
        if f.parent == SHM:
            f.unlink(missing_ok=True)
    return names


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie has exited: it holds no namespace.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _start_time(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def register_run(run_id: str) -> None:
    """Record this process as the owner of run ``run_id``."""
    REGISTRY.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    (REGISTRY / run_id).write_text(f"{pid} {_start_time(pid)}\n")


def unregister_run(run_id: str) -> None:
    (REGISTRY / run_id).unlink(missing_ok=True)


def run_is_live(run_id: str) -> bool:
    """True while the process that made run ``run_id`` still runs (pid and start time match)."""
    try:
        pid_s, started = ((REGISTRY / run_id).read_text().split() + [""])[:2]
        pid = int(pid_s)
    except (OSError, ValueError):
        return False
    return _alive(pid) and _start_time(pid) == started


def cleanup_stale(prefix: str = PREFIX, include_live: bool = False) -> list[str]:
    """Remove the namespaces (and with them veths, bridge and qdiscs) left by crashed runs.

    Removes every namespace starting with ``prefix`` whose run's owner process is gone; with
    ``include_live`` also those of live runs. Returns the names removed.
    """
    assert prefix.startswith(PREFIX), f"only isthmus namespaces ({PREFIX}*) are cleaned, not {prefix!r}"
    removed: list[str] = []
    runs: dict[str, list[str]] = {}
    for name in list_namespaces(prefix):
        m = _RUN_RE.match(name)
        if m:
            runs.setdefault(m.group(1), []).append(name)
    for run_id in runs:
        if include_live or not run_is_live(run_id):
            removed += delete_prefix(run_prefix(run_id))
            unregister_run(run_id)
    if NETNS_ETC.is_dir():  # hosts files of namespaces already gone (a run killed while removing them)
        for folder in NETNS_ETC.glob(f"{prefix}*"):
            m = _RUN_RE.match(folder.name)
            if m and (include_live or not run_is_live(m.group(1))):
                _remove_etc(folder.name)
    if REGISTRY.is_dir():  # registry entries of runs whose namespaces are already gone
        for entry in REGISTRY.iterdir():
            if entry.name not in runs and not run_is_live(entry.name):
                entry.unlink(missing_ok=True)
    if removed:
        get_logger().info("removed %d stale emulator namespace(s): %s", len(removed), ", ".join(removed))
    return removed
