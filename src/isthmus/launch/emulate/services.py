"""What an emulation runs beside the ranks: its reaper, the WAN delay line, the agents' rendezvous
store or a fault-tolerant run's torchft Lighthouse.

Each is a :class:`~isthmus.launch.emulate.processes.Helper`: watched while the run goes on, since
none of them ends by itself before the run does and the ranks cannot tell that one has gone (a dead
delay line only makes their collectives wait, until the group timeout blames a rank). When one
dies, every datacenter is stopped at once and :class:`~isthmus.launch.emulate.processes.HelperDied`
names it. Each is stopped with the emulation's other children at teardown.

The rendezvous store of a job over every datacenter is served by a process of its own in dc0's
namespace, not by dc0's agent: after the agents' exit barrier each agent still closes the
rendezvous in the store, and an agent that hosted it would take it away as it exits while another
is still closing (a C++ "Connection reset by peer" trace on a run that succeeded;
pytorch/pytorch#69520). Started before the agents and stopped after the last of them, the store
outlives them all.
"""

from __future__ import annotations

import select
import subprocess
import sys
from collections.abc import Sequence

from isthmus.launch import netns
from isthmus.launch.delayline import DelayLineSpec, delay_line_argv
from isthmus.launch.emulate.network import BRIDGE, LIGHTHOUSE_ADDRESS
from isthmus.launch.emulate.processes import Emulation, Helper
from isthmus.launch.reaper import start_reaper

RDZV_PORT = 29400
LIGHTHOUSE_PORT = 29510
READY_TIMEOUT_S = 60.0
"""How long a service may take to say it is ready."""


def start_service(em: Emulation, namespace: str, argv: Sequence[str], what: str, name: str) -> str:
    """Start ``argv`` in ``namespace`` as a helper of the emulation called ``name`` and return the
    first line it prints, which says it is ready; ``what`` names it when it does not start."""
    proc = em.start(namespace, argv, stdout=subprocess.PIPE, text=True)
    em.helpers.append(Helper(name, proc))
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
    line = proc.stdout.readline().strip() if ready else ""
    if not line:
        raise RuntimeError(f"the {what} did not start in {namespace} (exit code {proc.poll()})")
    return line


def start_watched_reaper(em: Emulation) -> subprocess.Popen[bytes]:
    """Start the reaper of ``em``'s run (:mod:`isthmus.launch.reaper`, outside every namespace) and
    watch it: a run that lost it would have no one left to clean up after a SIGKILL."""
    reaper = start_reaper(em.run_id)
    em.helpers.append(Helper("the emulator's reaper", reaper))
    return reaper


def _between(names: list[str]) -> str:
    return " and ".join(names) if len(names) <= 2 else f"{', '.join(names[:-1])} and {names[-1]}"


def start_delay_line(em: Emulation) -> None:
    """Start the forwarder that delays the WAN (:mod:`isthmus.launch.delayline`) in the bridge's
    namespace; it is stopped with the emulation's other children, and with that namespace's processes."""
    n = len(em.dcs)
    spec = DelayLineSpec(
        namespaces=[dc.namespace for dc in em.dcs],
        addresses=[dc.address for dc in em.dcs],
        delay_s=[[em.network.rtt_ms(i, j) / 2e3 if i != j else 0.0 for j in range(n)] for i in range(n)],
    )
    name = f"the WAN delay line between {_between([dc.name for dc in em.dcs])}"
    line = start_service(em, em.bridge_namespace, delay_line_argv(spec), "WAN delay line", name)
    if line != "ready":
        raise RuntimeError(f"the WAN delay line did not start in {em.bridge_namespace}: {line}")


def _server_argv(name: str, *args: object) -> list[str]:
    return [sys.executable, "-m", "isthmus.launch.emulate.servers", name, *map(str, args)]


def serve_lighthouse(
    em: Emulation, heartbeat_timeout_ms: int = 5000, join_timeout_ms: int = 10000, port: int = LIGHTHOUSE_PORT
) -> str:
    """Start a torchft Lighthouse on the bridge (``LIGHTHOUSE_ADDRESS``, given to the bridge here)
    and return its ``http://`` address."""
    wan = em.bridge_namespace
    netns.sh("ip", "-n", wan, "addr", "add", f"{LIGHTHOUSE_ADDRESS}/24", "dev", BRIDGE)
    argv = _server_argv("lighthouse", LIGHTHOUSE_ADDRESS, port, heartbeat_timeout_ms, join_timeout_ms)
    line = start_service(em, wan, argv, "torchft lighthouse", "the torchft lighthouse")
    if not line.startswith("http://"):
        raise RuntimeError(f"the torchft lighthouse did not start in {wan}: {line}")
    return line


def serve_rendezvous_store(em: Emulation, port: int = RDZV_PORT) -> None:
    """Serve the agents' c10d rendezvous store on dc0's address until the emulation's teardown,
    which stops it after every agent has exited."""
    dc0 = em.dcs[0]
    argv = _server_argv("store", dc0.address, port)
    start_service(em, dc0.namespace, argv, "rendezvous store", f"the agents' rendezvous store in {dc0.name}")
