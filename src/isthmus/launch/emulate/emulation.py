"""An emulation's lifetime: the network made with its reaper and delay line, then all of it removed.

Everything made here (namespaces, bridge, veths, qdiscs, the hosts files of ``/etc/netns``, the
files the run's processes had in ``/dev/shm``) is removed on exit, on an exception, on SIGINT /
SIGTERM / SIGHUP; when this process is killed with SIGKILL, its reaper (:mod:`isthmus.launch.reaper`,
started before anything is made) stops the run's processes and removes it. The root namespace is
never touched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from isthmus.launch import netns
from isthmus.launch.delayline import DELAY_LINE_CEILING_MBIT
from isthmus.launch.emulate.network import EmulatedNetwork, build_network, datacenter_namespaces
from isthmus.launch.emulate.processes import Emulation, signals_ignored, signals_raise
from isthmus.launch.emulate.services import start_delay_line, start_watched_reaper
from isthmus.launch.reaper import dismiss_reaper
from isthmus.log import get_logger


@contextmanager
def emulated_network(net: EmulatedNetwork, clean_stale: bool = True) -> Iterator[Emulation]:
    """Make the namespaces, bridge, veths and qdiscs of ``net`` (and its delay line when it has an
    RTT); remove them all on the way out.

    ``clean_stale`` first removes namespaces left by emulator runs whose process is gone.
    """
    netns.require_root()
    if clean_stale:
        netns.cleanup_stale()
    run_id = netns.new_run_id()
    prefix = netns.run_prefix(run_id)
    dcs = datacenter_namespaces(net, prefix)
    em = Emulation(net, run_id, dcs)
    log = get_logger()
    with signals_raise():
        reaper = None
        try:
            netns.register_run(run_id)
            # Before anything is made: whatever exists of the run when this process dies is reaped.
            reaper = start_watched_reaper(em)
            build_network(net, dcs, prefix)
            if net.delayed:
                start_delay_line(em)
                if max(net.distinct_rates_mbit()) > DELAY_LINE_CEILING_MBIT:
                    log.warning(
                        "WAN rates above %g Mbit/s may not be reached with latency: the delay line is one "
                        "Python process (about 500-800 Mbit/s on 2 shared cores)",
                        DELAY_LINE_CEILING_MBIT,
                    )
            log.info(
                "emulated %d datacenter(s) in namespaces %s*: %s; WAN %s Mbit/s, RTT %s ms%s",
                len(dcs),
                prefix,
                ", ".join(f"{d.name}={d.address} x{d.ranks}" for d in dcs),
                "/".join(f"{r:g}" for r in net.distinct_rates_mbit()),
                "/".join(f"{r:g}" for r in net.distinct_rtts_ms()),
                " (user-space delay line)" if net.delayed else "",
            )
            yield em
        finally:
            with signals_ignored():
                em.close()
                if reaper is not None:
                    dismiss_reaper(reaper)
