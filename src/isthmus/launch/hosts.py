"""Emulated hosts on one machine: N network namespaces on one bridge, each a host with its own
address and hostname, for rehearsing (and testing) a multi-node run as it runs on real nodes.

The picture for N hosts::

    ist-<id>-host0 [wan0 10.213.0.100, hostname host0] ──veth──┐
    ist-<id>-host1 [wan0 10.213.0.101, hostname host1] ──veth──┤ br0 in ist-<id>-wan
    ...                                                         ┘

Unlike the datacenter emulator (:mod:`isthmus.launch.emulate`) nothing is shaped or delayed, and
the processes are told nothing about where they run: a process on host ``i`` sees only what a
process on a real node sees. Its hostname is ``host<i>`` (a UTS namespace of its own, made by
``unshare --uts`` for every command started here), and every host's name resolves to its address
on every host through ``/etc/netns/<namespace>/hosts`` (which ``ip netns exec`` puts over
``/etc/hosts``), so ``torchrun --rdzv-endpoint host0:29400`` finds host 0, torchrun's agent on
host 0 sees that the endpoint is itself and hosts the c10d store, and gloo binds the address the
hostname resolves to. ``/dev/shm`` and the file system are shared, as the run directory of a
cluster file system is.

The API::

    with EmulatedHosts(2) as hosts:             # root; made here, removed on every way out
        hosts.name(1), hosts.address(1)         # "host1", "10.213.0.101"
        p = hosts.popen(1, ["python", "-c", "import socket; print(socket.gethostname())"])
        hosts.run(0, ["hostname"])              # to its end (subprocess.run)
        hosts.kill(1)                           # host 1 dies: SIGKILL to everything on it
    # every namespace, veth, hosts file and /dev/shm file of the run is gone here

:func:`torchrun_argv` is the command one host runs to join an N-node job, as on a real node;
:func:`run_torchrun_job` runs it on every host and watches the job to its end (what
``isthmus emulate --hosts N`` does).

Everything is removed on leaving the block (an exception and Ctrl-C included; with
``handle_signals``, SIGTERM and SIGHUP too), and by the run's reaper (:mod:`isthmus.launch.reaper`)
when the owning process is killed outright; :func:`isthmus.launch.netns.cleanup_stale` removes what
a crashed owner left. The namespaces, registry and reaper are the datacenter emulator's own.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from isthmus.errors import IsthmusError
from isthmus.launch import netns
from isthmus.launch.emulate.network import bridge_namespace, build_bridge, member_address
from isthmus.launch.emulate.processes import how_it_ended, signals_ignored, signals_raise, stop_process_groups
from isthmus.launch.reaper import dismiss_reaper, start_reaper

MAX_HOSTS = 154
"""As many as the bridge's addresses (10.213.0.100 to .253)."""

RDZV_PORT = 29400
"""torchrun's default c10d port, on host 0."""

# `unshare --uts` gives the command a UTS namespace of its own; this names the host in it and
# execs the command (util-linux's unshare sets no hostname; Python < 3.12 has no os.unshare).
_SET_HOSTNAME = "import os, socket, sys; socket.sethostname(sys.argv[1]); os.execvp(sys.argv[2], sys.argv[2:])"
_RUN_ID = re.compile(r"^[0-9a-f]{6}$")


def require_root() -> None:
    """Fail with one line unless this process can make namespaces and name hosts."""
    if os.geteuid() != 0:
        raise IsthmusError("emulated hosts need root (ip netns, veth, unshare --uts): run it as root")
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            raise IsthmusError(f"emulated hosts need `{tool}` on PATH (iproute2, util-linux)")


class EmulatedHosts:
    """``n`` emulated hosts (see the module docstring); a context manager that makes and removes them.

    ``run_id``: six hex digits naming the run's namespaces (``ist-<run_id>-host<i>``; default: a new
    one). ``clean_stale``: first remove what emulator runs whose owner is gone left behind.
    ``handle_signals``: while the block runs, SIGTERM and SIGHUP raise ``SystemExit(128 + N)``
    (SIGINT: KeyboardInterrupt), so the hosts are removed; only from the main thread.
    """

    def __init__(
        self, n: int, run_id: str | None = None, *, clean_stale: bool = True, handle_signals: bool = True
    ) -> None:
        if not 1 <= n <= MAX_HOSTS:
            raise ValueError(f"emulated hosts: {n} hosts; between 1 and {MAX_HOSTS}")
        self.n = n
        self.run_id = run_id or netns.new_run_id()
        assert _RUN_ID.match(self.run_id), f"a run id is six hex digits, not {self.run_id!r}"
        self._clean_stale = clean_stale
        self._handle_signals = handle_signals
        self._children: list[subprocess.Popen[Any]] = []
        self._shm: set[Path] = set()
        self._stack: ExitStack | None = None
        self._reaper: subprocess.Popen[bytes] | None = None

    @property
    def prefix(self) -> str:
        """Every namespace of this run starts with this (``ist-<run_id>-``)."""
        return netns.run_prefix(self.run_id)

    def name(self, i: int) -> str:
        """Host ``i``'s hostname, ``host<i>``: what it calls itself and what every host resolves."""
        return f"host{self._index(i)}"

    def address(self, i: int) -> str:
        """Host ``i``'s IPv4 address (on its interface ``wan0``)."""
        return member_address(self._index(i))

    def namespace(self, i: int) -> str:
        """Host ``i``'s network namespace (``ip netns exec`` it to look around)."""
        return f"{self.prefix}host{self._index(i)}"

    def _index(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"host {i}: there are {self.n} hosts (0..{self.n - 1})")
        return i

    def __enter__(self) -> EmulatedHosts:
        require_root()
        if self._clean_stale:
            netns.cleanup_stale()
        stack = ExitStack()
        if self._handle_signals:
            stack.enter_context(signals_raise())
        stack.callback(self.close)
        try:
            netns.register_run(self.run_id)
            # Before anything is made: whatever exists of the run when this process dies is reaped.
            self._reaper = start_reaper(self.run_id)
            build_bridge(self.prefix, [(self.namespace(i), self.address(i)) for i in range(self.n)], port="host")
            names = {self.address(i): self.name(i) for i in range(self.n)}
            for ns in [bridge_namespace(self.prefix), *(self.namespace(i) for i in range(self.n))]:
                netns.write_hosts(ns, names)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` on host ``i``: in its namespace, named ``host<i>``."""
        return [
            "ip",
            "netns",
            "exec",
            self.namespace(i),
            "unshare",
            "--uts",
            "--",
            sys.executable,
            "-c",
            _SET_HOSTNAME,
            self.name(i),
            *argv,
        ]

    def popen(
        self, i: int, argv: Sequence[str], env: dict[str, str] | None = None, **popen: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` on host ``i`` (``env`` adds to this process's environment; ``popen`` goes to
        ``subprocess.Popen``). It runs in a session of its own, so its process group is all of it
        (``os.killpg(p.pid, sig)``) and a Ctrl-C at the terminal reaches only this process; it is
        stopped (SIGTERM, then SIGKILL) when the hosts are removed."""
        popen.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.argv(i, argv), env={**os.environ, **(env or {})}, **popen)
        self._children.append(proc)
        return proc

    def run(
        self, i: int, argv: Sequence[str], env: dict[str, str] | None = None, timeout: float = 60, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on host ``i`` to its end, its output captured as text (``kw``: ``subprocess.run``'s)."""
        kw.setdefault("capture_output", True)
        return subprocess.run(self.argv(i, argv), env={**os.environ, **(env or {})}, text=True, timeout=timeout, **kw)

    def pids(self, i: int) -> list[int]:
        """Every process running on host ``i``."""
        return netns.namespace_pids(self.namespace(i))

    def kill(self, i: int, sig: int = signal.SIGKILL) -> list[int]:
        """Host ``i`` dies: ``sig`` (default SIGKILL) to every process on it, whoever started it.
        Returns their pids. Its network stays; the others see its connections reset or time out."""
        self._shm |= netns.shared_memory_files(self.prefix)  # SIGKILLed processes remove nothing there
        pids = self.pids(i)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def close(self) -> None:
        """Stop every process started here and every process left on a host, then remove the run's
        namespaces (veths and bridge go with them), hosts files and /dev/shm files. Idempotent."""
        with signals_ignored():
            self._shm |= netns.shared_memory_files(self.prefix)
            stop_process_groups(self._children, grace_s=3.0)
            # What is left on the hosts outlived the processes started here, which were given their
            # chance to stop: it goes as with the host's power (a rank server waits out SIGTERM).
            if netns.list_namespaces(self.prefix):
                for i in range(self.n):
                    self.kill(i)
            netns.delete_prefix(self.prefix, self._shm)
            netns.unregister_run(self.run_id)
            if self._reaper is not None:
                dismiss_reaper(self._reaper)
                self._reaper = None
            self._children.clear()


def torchrun_argv(
    nnodes: int | str,
    nproc_per_node: int,
    endpoint: str,
    rdzv_id: str,
    target: Sequence[str],
    max_restarts: int = 0,
    agent: str = "isthmus.launch.agent",
) -> list[str]:
    """What one node runs to join a ``nnodes``-node job (``"MIN:MAX"`` for an elastic one): torchrun's
    c10d rendezvous at ``endpoint`` (``host0:29400``), ``nproc_per_node`` ranks of ``target``
    (``["-m", "isthmus", "train", ...]`` or a script and its arguments).

    The agent is torchrun's own (:mod:`isthmus.launch.agent`: same arguments, its exit said as an
    exit code), or the module ``agent`` names (``torch.distributed.run``: torchrun itself). As on
    real nodes nothing else is given: no ``--node-rank`` (c10d ignores it; nodes are ordered by
    hostname), no ``--local-addr`` (the hostname), no store of the launcher's.
    """
    return [
        sys.executable,
        "-m",
        agent,
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        rdzv_id,
        "--max-restarts",
        str(max_restarts),
        *target,
    ]


@dataclass(frozen=True)
class JobEnd:
    """How a job on the emulated hosts ended."""

    code: int
    """0; the first failed host's agent's exit code (its first failed rank's); 128 + N when stopped
    by signal N (Ctrl-C: 130); 124 past the time limit."""
    host: int | None = None
    """The host whose agent failed first; None when none did."""
    how: str = ""
    """How that agent ended (``exit code 3``, ``killed by SIGKILL``)."""


def run_torchrun_job(
    hosts: EmulatedHosts,
    nproc_per_node: int,
    target: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    out: IO[str] | None = None,
    timeout_s: float | None = None,
    grace_s: float = 10.0,
    port: int = RDZV_PORT,
) -> JobEnd:
    """Run ``target`` as one job of ``hosts.n`` nodes x ``nproc_per_node`` ranks: one torchrun per host
    (:func:`torchrun_argv`), meeting at ``host0:port``. Waits for every agent; the first that fails,
    Ctrl-C, SIGTERM or ``timeout_s`` stops the others (SIGTERM to each host's agent and its ranks,
    SIGKILL after ``grace_s``), as a cluster's scheduler would.

    ``out``: each line the agents and their ranks print, as ``host<i>| line`` (default: discarded;
    the ranks' own logs stay in the run directory). ``env`` adds to every host's environment.
    """
    rdzv_id = f"isthmus-{hosts.run_id}-{netns.new_run_id()}"  # one per job: jobs may follow each other
    argv = torchrun_argv(hosts.n, nproc_per_node, f"{hosts.name(0)}:{port}", rdzv_id, target)
    # What torchrun would set (announcing it in a banner) when it is not set.
    base = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
    lock = threading.Lock()
    procs: list[subprocess.Popen[str]] = []
    readers: list[threading.Thread] = []
    for i in range(hosts.n):
        p = hosts.popen(i, argv, env=base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(p)
        readers.append(threading.Thread(target=_relay, args=(p, f"{hosts.name(i)}| ", out, lock), daemon=True))
        readers[-1].start()
    end = _watch(procs, timeout_s, grace_s)
    # What the agents and ranks printed is in the pipes by now; a rank server the agent started may
    # hold them open a few seconds longer as it exits, with nothing more to say.
    deadline = time.monotonic() + 1.0
    for r in readers:
        r.join(timeout=max(0.0, deadline - time.monotonic()))
    return end


def _relay(proc: subprocess.Popen[str], prefix: str, out: IO[str] | None, lock: threading.Lock) -> None:
    """Copy ``proc``'s output to ``out``, each line after ``prefix``, until it closes."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if out is not None:
            with lock:
                out.write(prefix + line)
                out.flush()


def _watch(procs: list[subprocess.Popen[str]], timeout_s: float | None, grace_s: float) -> JobEnd:
    """Wait until every agent exits (0), the first fails, Ctrl-C or SIGTERM, or ``timeout_s``; then
    stop whatever still runs."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    end = JobEnd(0)
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None:
                code = codes[failed]
                assert code is not None
                # An agent killed by a signal has no code of its own: the job failed (exit 3, as
                # isthmus's RunFailed), not the signal the watcher would have been stopped by.
                end = JobEnd(code if code > 0 else 3, failed, how_it_ended(code))
                break
            if all(c == 0 for c in codes):
                return end
            if deadline is not None and time.monotonic() > deadline:
                end = JobEnd(124)
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        end = JobEnd(128 + signal.SIGINT)
    except SystemExit as e:  # SIGTERM / SIGHUP, raised by EmulatedHosts(handle_signals=True)
        end = JobEnd(e.code if isinstance(e.code, int) else 1)
    with signals_ignored():
        stop_process_groups(procs, grace_s)
    return end
