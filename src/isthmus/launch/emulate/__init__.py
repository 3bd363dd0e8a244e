"""Emulated datacenters on one machine: one network namespace per datacenter, WAN links shaped by tc
and delayed by a user-space delay line.

`isthmus emulate --topology FILE -- train ...` lands in :func:`launch_emulated`. Each datacenter's
ranks run inside its namespace, with gloo bound to its WAN interface; what is made is removed on
every way out, SIGKILL included. The modules, one job each:

- :mod:`~isthmus.launch.emulate.network`: what to emulate (:class:`EmulatedNetwork`) and the
  namespaces, bridge, veths, addresses and qdiscs made for it.
- :mod:`~isthmus.launch.emulate.processes`: the live emulation (:class:`Emulation`) and the
  processes started in it: watched, stopped, their ``/dev/shm`` files removed.
- :mod:`~isthmus.launch.emulate.services`: what runs beside the ranks (reaper, delay line,
  rendezvous store, Lighthouse); :mod:`~isthmus.launch.emulate.servers` is the store's and the
  Lighthouse's ``python -m`` entry inside a namespace.
- :mod:`~isthmus.launch.emulate.emulation`: :func:`emulated_network`, the network made and removed.
- :mod:`~isthmus.launch.emulate.agents`: a torchrun agent per datacenter, watched until the run ends.

Measuring the emulated WAN as an application sees it: :mod:`isthmus.launch.wanprobe`.
"""

from isthmus.launch.emulate.agents import launch_emulated, torchrun_argv
from isthmus.launch.emulate.emulation import emulated_network
from isthmus.launch.emulate.network import (
    MAX_RTT_MS,
    MAX_WINDOW_KIB,
    MIN_WINDOW_KIB,
    DatacenterNamespace,
    EmulatedDatacenter,
    EmulatedNetwork,
)
from isthmus.launch.emulate.processes import Emulation, Helper, HelperDied, stop_process_groups
from isthmus.launch.emulate.services import serve_lighthouse, serve_rendezvous_store, start_delay_line

__all__ = [
    "MAX_RTT_MS",
    "MAX_WINDOW_KIB",
    "MIN_WINDOW_KIB",
    "DatacenterNamespace",
    "EmulatedDatacenter",
    "EmulatedNetwork",
    "Emulation",
    "Helper",
    "HelperDied",
    "emulated_network",
    "launch_emulated",
    "serve_lighthouse",
    "serve_rendezvous_store",
    "start_delay_line",
    "stop_process_groups",
    "torchrun_argv",
]
