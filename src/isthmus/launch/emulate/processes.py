"""The processes of an emulation: started inside a datacenter's namespace, watched, stopped.

Every child gets its own session: a Ctrl-C at the terminal reaches only the emulate process, which
then stops the children in order (SIGTERM to each process group, SIGKILL to what is left). Before
stopping them, it notes the files the run's processes hold in ``/dev/shm``: a process killed with
SIGKILL (multiprocessing's resource tracker among them) removes nothing there, so teardown does.

A :class:`Helper` is a child that must run as long as the run does (the reaper, the delay line, the
rendezvous store or Lighthouse); when one dies, :class:`HelperDied` names it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isthmus.errors import RunFailed
from isthmus.launch import netns
from isthmus.launch.emulate.network import DatacenterNamespace, EmulatedNetwork, bridge_namespace

HELPER_DEATH_GRACE_S = 2.0
"""How long ranks get to stop on SIGTERM once a helper died: those in a collective cannot (the WAN
or a peer they wait for is gone), and nothing they could still finish is worth a longer wait."""


def how_it_ended(returncode: int) -> str:
    """``killed by SIGKILL`` or ``exit code 3``: a process's end as a user's line says it."""
    if returncode < 0 and -returncode in signal.valid_signals():
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


@dataclass(frozen=True)
class Helper:
    """A process the emulator started that must run as long as the run does."""

    name: str
    """How a user's error line names it: ``the WAN delay line between dc0 and dc1``."""
    proc: subprocess.Popen[Any]

    def death(self) -> str | None:
        """``<name> (pid N) died (killed by SIGKILL)`` once it has ended; None while it runs."""
        code = self.proc.poll()
        return None if code is None else f"{self.name} (pid {self.proc.pid}) died ({how_it_ended(code)})"


class HelperDied(RunFailed):
    """A helper of the emulation died during the run; every datacenter was stopped."""

    def __init__(self, death: str) -> None:
        self.death = death
        super().__init__(f"{death}; stopped every datacenter and removed the network")


@dataclass
class Emulation:
    """A live emulated network and the processes started in it; made and removed by
    :func:`isthmus.launch.emulate.emulated_network`."""

    network: EmulatedNetwork
    run_id: str
    dcs: list[DatacenterNamespace]
    _children: list[subprocess.Popen[Any]] = field(default_factory=list, repr=False)
    helpers: list[Helper] = field(default_factory=list)
    """What :meth:`dead_helper` watches (the agents are watched by the launcher: they end when the run does)."""
    _shm: set[Path] = field(default_factory=set, repr=False)

    @property
    def prefix(self) -> str:
        """Every namespace of this run starts with this (``ist-<id>-``)."""
        return netns.run_prefix(self.run_id)

    @property
    def bridge_namespace(self) -> str:
        return bridge_namespace(self.prefix)

    @property
    def namespaces(self) -> list[str]:
        return [self.bridge_namespace, *(dc.namespace for dc in self.dcs)]

    def dc_env(self, dc_index: int) -> dict[str, str]:
        """What every rank of datacenter ``dc_index`` gets: its interface and where it is."""
        dc = self.dcs[dc_index]
        return {
            "GLOO_SOCKET_IFNAME": dc.ifname,
            "ISTHMUS_DC_INDEX": str(dc.index),
            "ISTHMUS_N_DC": str(len(self.dcs)),
            "ISTHMUS_DC_NAME": dc.name,
            "ISTHMUS_DC_RANKS": str(dc.ranks),
            "ISTHMUS_DC_LAYOUT": ",".join(str(d.ranks) for d in self.dcs),
        }

    def start(
        self, namespace: str, argv: Sequence[str], env: dict[str, str] | None = None, **popen: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``namespace`` (one of this run's); ``env`` adds to this process's.

        The child gets its own session unless ``popen`` says otherwise, and is stopped at teardown
        if still running.
        """
        popen.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", namespace, *argv], env={**os.environ, **(env or {})}, **popen)
        self._children.append(proc)
        return proc

    def run_in(
        self, dc_index: int, argv: Sequence[str], env: dict[str, str] | None = None, **popen: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` inside datacenter ``dc_index``'s namespace, as :meth:`start`."""
        return self.start(self.dcs[dc_index].namespace, argv, env, **popen)

    def dead_helper(self) -> str | None:
        """The first helper that has died, as :meth:`Helper.death` says it; None while all run."""
        return next((d for h in self.helpers if (d := h.death()) is not None), None)

    def stop_orphans(self, agent: subprocess.Popen[Any]) -> None:
        """SIGKILL the ranks of an agent that died (noting their /dev/shm files first, as :meth:`stop`):
        they are in its process group (its own session), which outlives its leader while they run,
        so its number names no one else's group."""
        self._shm |= netns.shared_memory_files(self.prefix)
        try:
            os.killpg(agent.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, procs: Sequence[subprocess.Popen[Any]], grace_s: float) -> None:
        """:func:`stop_process_groups`, noting first what the run's processes hold in /dev/shm, which
        :meth:`close` removes."""
        self._shm |= netns.shared_memory_files(self.prefix)
        stop_process_groups(procs, grace_s)

    def close(self) -> None:
        """Stop the children, then remove every namespace of this run (veths and qdiscs go with them)
        and the files its processes left in /dev/shm."""
        self.stop(self._children, grace_s=3.0)
        netns.delete_prefix(self.prefix, self._shm)
        netns.unregister_run(self.run_id)


def stop_process_groups(procs: Sequence[subprocess.Popen[Any]], grace_s: float) -> None:
    """SIGTERM each child's process group, SIGKILL what is left after ``grace_s``; reap the children."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        running = [p for p in procs if p.poll() is None]
        if not running:
            return
        for p in running:
            try:
                if os.getpgid(p.pid) == p.pid:  # its own group (start's default): reach its children too
                    os.killpg(p.pid, sig)
                else:
                    p.send_signal(sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait_s
        for p in running:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


_TEARDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def signals_raise() -> Iterator[None]:
    """Turn SIGINT into KeyboardInterrupt and SIGTERM/SIGHUP into SystemExit(128+sig), so finally runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: object) -> None:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, handler) for s in _TEARDOWN_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextmanager
def signals_ignored() -> Iterator[None]:
    """Teardown runs to the end: a second Ctrl-C must not leave half the namespaces behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in _TEARDOWN_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
