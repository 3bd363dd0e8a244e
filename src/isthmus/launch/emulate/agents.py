"""The datacenters' torchrun agents: one per datacenter in its namespace, started, watched, stopped.

What a rank reads to know where it runs (set by :func:`launch_emulated` for every rank):

- ``ISTHMUS_DC_INDEX``: this rank's datacenter, 0..N-1 (authoritative).
- ``ISTHMUS_N_DC``: N; ``ISTHMUS_DC_NAME``: the datacenter's name.
- ``ISTHMUS_DC_RANKS``: ranks in this datacenter; ``ISTHMUS_DC_LAYOUT``: ranks of every
  datacenter in order, comma-separated (``"2,2"``).

torchrun's c10d rendezvous sorts nodes by their ``--local-addr``; the datacenters' addresses sort
in datacenter order (:mod:`isthmus.launch.emulate.network`), so ``GROUP_RANK == ISTHMUS_DC_INDEX``
and the global ranks of datacenter ``i`` are the contiguous block starting at ``sum(layout[:i])``:
``RANK = start + LOCAL_RANK``.

The agents are watched as the helpers are: under ``geo.fault_tolerant`` a datacenter whose agent
died is lost as when its ranks fail, and the others train on; otherwise its death stops every
datacenter and :class:`~isthmus.launch.emulate.processes.HelperDied` names it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, Literal

from isthmus.launch.emulate.emulation import emulated_network
from isthmus.launch.emulate.network import EmulatedNetwork
from isthmus.launch.emulate.processes import (
    HELPER_DEATH_GRACE_S,
    Emulation,
    Helper,
    HelperDied,
    signals_ignored,
)
from isthmus.launch.emulate.services import RDZV_PORT, serve_lighthouse, serve_rendezvous_store
from isthmus.log import get_logger


def torchrun_argv(
    em: Emulation, dc_index: int, train_argv: Sequence[str], script: str | None = None, rdzv_port: int = RDZV_PORT
) -> list[str]:
    """The elastic agent of datacenter ``dc_index``: node ``dc_index`` of an N-node c10d job
    (torchrun's, through :mod:`isthmus.launch.agent`).

    The c10d store listens on dc0's address, served by
    :func:`~isthmus.launch.emulate.services.serve_rendezvous_store`: no agent hosts it (``is_host=0``;
    inside a namespace the hostname heuristic could not tell anyway). ``--local-addr`` makes the
    workers' MASTER_ADDR dc0's address and orders the nodes (see the module docstring).
    ``--node-rank`` is not passed: c10d ignores it.
    """
    dc, dc0 = em.dcs[dc_index], em.dcs[0]
    target = ["-m", "isthmus"] if script is None else [script]
    return [
        sys.executable,
        "-m",
        "isthmus.launch.agent",  # torchrun, quiet about its exit
        "--nnodes",
        str(len(em.dcs)),
        "--nproc-per-node",
        str(dc.ranks),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{dc0.address}:{rdzv_port}",
        "--rdzv-id",
        f"isthmus-{em.run_id}",
        "--rdzv-conf",
        "is_host=0",
        "--local-addr",
        dc.address,
        "--max-restarts",
        "0",
        *target,
        *train_argv,
    ]


def torchrun_dc_job_argv(
    em: Emulation, dc_index: int, train_argv: Sequence[str], max_restarts: int, rdzv_port: int = RDZV_PORT
) -> list[str]:
    """Datacenter ``dc_index`` as a job of its own (``geo.fault_tolerant``): one node, its own c10d
    store on its own address, and torch's elastic restarts of its ranks (up to ``max_restarts``),
    which then rejoin the others through torchft."""
    dc = em.dcs[dc_index]
    return [
        sys.executable,
        "-m",
        "isthmus.launch.agent",  # torchrun, quiet about its exit
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(dc.ranks),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{dc.address}:{rdzv_port}",
        "--rdzv-id",
        f"isthmus-{em.run_id}-dc{dc_index}",
        "--rdzv-conf",
        "is_host=1",
        "--local-addr",
        dc.address,
        "--max-restarts",
        str(max_restarts),
        "-m",
        "isthmus",
        *train_argv,
    ]


def _agent_death(em: Emulation, procs: list[subprocess.Popen[Any]]) -> tuple[int, str] | None:
    """(index, what died) of the first datacenter whose agent was killed by a signal: its ranks are
    left without it, and nobody else would stop them; an agent that exits (even with a failure) says
    its ranks' end and is not a death."""
    for i, p in enumerate(procs):
        code = p.poll()
        if code is not None and code < 0:
            return i, Helper(f"the torchrun agent of {em.dcs[i].name}", p).death() or ""
    return None


# What a poll of the agents found: every agent ended ("done", the run's code, nothing left to stop),
# a failure that stops the rest ("stop", its code), or a dead helper or agent ("died", its line).
_Outcome = tuple[Literal["done", "stop", "died"], int | str] | None


def _watch(
    em: Emulation,
    procs: list[subprocess.Popen[Any]],
    timeout_s: float | None,
    grace_s: float,
    poll: Callable[[], _Outcome],
) -> int:
    """Poll until `poll` reports an ending, the deadline passes, Ctrl-C or SIGTERM; then stop every agent.

    Raises :class:`HelperDied` when `poll` found a helper of the emulation or an agent dead."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    rc = 0
    death = None
    try:
        while True:
            outcome = poll()
            if outcome is not None:
                kind, value = outcome
                if kind == "done":
                    return int(value)
                if kind == "died":
                    death = str(value)
                else:
                    rc = int(value)
                break
            if deadline is not None and time.monotonic() > deadline:
                get_logger().error("emulated run passed its %ss limit: stopping every datacenter", timeout_s)
                rc = 124
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        rc = 128 + signal.SIGINT
    except SystemExit as e:  # SIGTERM / SIGHUP through signals_raise
        rc = e.code if isinstance(e.code, int) else 1
    with signals_ignored():
        em.stop(procs, grace_s if death is None else HELPER_DEATH_GRACE_S)
    if death is not None:
        raise HelperDied(death)
    return rc


def _wait_all(em: Emulation, procs: list[subprocess.Popen[Any]], timeout_s: float | None, grace_s: float) -> int:
    """geo.fault_tolerant: a datacenter that fails does not stop the others; wait for every one.

    Returns 0 when at least one datacenter completed (the run survived), else the first failure's code.
    Raises :class:`HelperDied` when a helper of the emulation died (the Lighthouse, the delay line)."""
    log = get_logger()
    names = [dc.name for dc in em.dcs]
    reported: set[int] = set()

    def poll() -> _Outcome:
        death = em.dead_helper()
        if death is not None:
            return "died", death
        codes = [p.poll() for p in procs]
        for i, c in enumerate(codes):
            if c not in (None, 0) and i not in reported:
                reported.add(i)
                if c < 0:  # its agent was killed: a datacenter lost, as when its ranks fail
                    em.stop_orphans(procs[i])
                    ended = f"{Helper(f'the torchrun agent of {names[i]}', procs[i]).death()}; stopped its ranks"
                else:
                    ended = f"datacenter {names[i]} ended with exit code {c}"
                others = [n for j, n in enumerate(names) if codes[j] is None]
                log.warning(
                    "%s; %s train on", ended, ", ".join(others) if others else "no other datacenter is running to"
                )
        if not all(c is not None for c in codes):
            return None
        done = [n for n, c in zip(names, codes) if c == 0]
        if done and reported:
            log.info("the run survived: %s completed", ", ".join(done))
        return "done", 0 if done else next(c for c in codes if c)

    return _watch(em, procs, timeout_s, grace_s, poll)


def _wait_first_failure(
    em: Emulation, procs: list[subprocess.Popen[Any]], timeout_s: float | None, grace_s: float
) -> int:
    """Wait for every agent; on the first non-zero exit, Ctrl-C, SIGTERM or timeout stop the rest.

    Raises :class:`HelperDied` when a helper of the emulation or an agent died."""

    def poll() -> _Outcome:
        death = em.dead_helper()
        lost = _agent_death(em, procs)
        if lost is not None:
            em.stop_orphans(procs[lost[0]])
            death = death or lost[1]
        if death is not None:
            return "died", death
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return "stop", failed[0]
        return ("done", 0) if all(c == 0 for c in codes) else None

    return _watch(em, procs, timeout_s, grace_s, poll)


def launch_emulated(
    net: EmulatedNetwork,
    train_argv: Sequence[str],
    *,
    script: str | None = None,
    env: dict[str, str] | None = None,
    log_dir: str | Path | None = None,
    timeout_s: float | None = None,
    grace_s: float = 10.0,
    rdzv_port: int = RDZV_PORT,
    fault_tolerant: bool = False,
    max_restarts: int = 0,
) -> int:
    """Run ``isthmus <train_argv>`` (or ``script``) on emulated datacenters; return the exit code.

    One torch elastic agent per datacenter, in its namespace, ``nproc_per_node`` = its ranks. The
    first non-zero exit (or Ctrl-C: 130, SIGTERM: 143, ``timeout_s``: 124) stops the others;
    the network is removed in every case. ``log_dir`` takes each agent's output as
    ``<log_dir>/dc<i>.log``; without it, output goes to this process's console.

    ``fault_tolerant`` (``geo.fault_tolerant``): a torchft Lighthouse on the bridge, each datacenter
    a job of its own whose ranks torch restarts up to ``max_restarts`` times (they rejoin from the
    global model); one datacenter's failure stops nothing, and the run succeeds when one completes.
    """
    log = get_logger()
    with emulated_network(net) as em:
        files: list[IO[str]] = []
        procs: list[subprocess.Popen[Any]] = []
        try:
            extra: dict[str, str] = {}
            if fault_tolerant:
                extra["TORCHFT_LIGHTHOUSE"] = serve_lighthouse(em)
                if max_restarts:
                    # As in launch/local.py: restarted ranks must not read the dead ones' gloo
                    # addresses from the agent's shared store (pytorch/pytorch#135712).
                    extra["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
                log.info(
                    "fault tolerant: torchft lighthouse at %s; each datacenter is its own job (restarts: %d)",
                    extra["TORCHFT_LIGHTHOUSE"],
                    max_restarts,
                )
            else:
                serve_rendezvous_store(em, rdzv_port)
            # What torchrun would set (and announce in a banner per agent) when it is not set; each
            # rank then sets its own thread count (isthmus.launch.local).
            extra["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
            for dc in em.dcs:
                out: IO[str] | None = None
                if log_dir is not None:
                    Path(log_dir).mkdir(parents=True, exist_ok=True)
                    out = open(Path(log_dir) / f"dc{dc.index}.log", "w")
                    files.append(out)
                if fault_tolerant:
                    argv = torchrun_dc_job_argv(em, dc.index, train_argv, max_restarts, rdzv_port)
                else:
                    argv = torchrun_argv(em, dc.index, train_argv, script, rdzv_port)
                procs.append(
                    em.run_in(
                        dc.index,
                        argv,
                        env={**em.dc_env(dc.index), **extra, **(env or {})},
                        stdout=out,
                        stderr=subprocess.STDOUT if out else None,
                        text=True,
                    )
                )
            log.info("started %d rank(s) in %d emulated datacenter(s)", net.world_size, len(em.dcs))
            if fault_tolerant:
                rc = _wait_all(em, procs, timeout_s, grace_s)
            else:
                rc = _wait_first_failure(em, procs, timeout_s, grace_s)
        except KeyboardInterrupt:  # while starting
            rc = 128 + signal.SIGINT
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        finally:
            for f in files:
                f.close()
    return rc
