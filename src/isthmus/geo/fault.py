"""Datacenter failure under diloco / streaming_diloco: the others train on, a restarted one rejoins.

``geo.fault_tolerant = true`` builds on torchft (PyTorch's fault-tolerance library) instead of one
torch.distributed job over every datacenter, because a gloo or NCCL group cannot lose a member:
once a peer dies, every collective on the group fails and the group must be torn down everywhere.

- Each datacenter is its own torch.distributed job (its own launcher, store and group): inner
  steps and the intra-datacenter all-gathers never see another datacenter.
- One torchft Lighthouse (``torchft_lighthouse``, at ``TORCHFT_LIGHTHOUSE``) forms a quorum of
  the live datacenters at every outer sync; a datacenter is dropped when its heartbeats stop.
- A torchft Manager per rank (replica group = datacenter, group rank = intra index) reconfigures
  a gloo group over rank j of every datacenter in the quorum, the same "inter" rings the
  non-fault-tolerant strategy uses, and sums the pseudo-gradient shards there. A collective that
  fails (a peer died mid-transfer) is not raised: ``should_commit`` says no and the round is
  dropped everywhere in that datacenter; the next quorum leaves the dead datacenter out.
- A datacenter behind the others (restarted, or one whose commit failed) heals at its next quorum:
  torchft sends it, over the same gloo group, this module's recovery state from a datacenter at
  the newest step: the global snapshot and outer momentum (this rank's shards) and the inner step.

Averaging over whoever contributed: each round all-reduces ``sum_dc w_dc * (snapshot - local)``
and ``sum_dc w_dc`` with w = 1 for a datacenter that trained from the current snapshot and w = 0
for one that has just healed (its local parameters say nothing about this round), so the outer
step uses the mean over the survivors' pseudo-gradients, never a diluted one. Every member of the
quorum sums the same values in the same group, so the snapshots stay identical; a healed
datacenter takes the new snapshot as its parameters and contributes again from the next round.

A datacenter that (re)starts calls :meth:`FaultTolerantDiLoCo.join` before its first step: with
every datacenter fresh it returns 0; behind the others, it blocks until their next outer sync,
heals, takes part in that round with weight 0 and returns the step they are at, where the trainer
continues (learning-rate schedule and data position included).

A fresh start waits for every datacenter (up to ``START_WAIT_S``) before its first step. The
Lighthouse forms a quorum of whoever asks as soon as no datacenter it has heard from is missing,
and it hears from a datacenter only once that one's Manager exists: the datacenters' ranks start
seconds apart (launchers, imports, data), so without the wait the first to start trained alone,
the other joined one outer step later, and in a run shorter than that gap none ever met.

Limits: fp32 outer gradients only (torchft's fault-tolerant path is an all-reduce; a quantised
all-gather is not wrapped); streaming needs each fragment's round to finish before the next
begins (``overlap_steps < inner_steps // fragments``: one Manager round at a time). The Lighthouse
is a single point of coordination: while it is down, outer syncs wait (up to the quorum timeout).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from isthmus.config import GeoConfig, resolved_outer_dtype
from isthmus.errors import ConfigError, IsthmusError
from isthmus.geo import accounting
from isthmus.geo.accounting import Scope
from isthmus.geo.buckets import unpack_params
from isthmus.geo.diloco import DiLoCoSync, _Transfer
from isthmus.geo.groups import GeoGroups
from isthmus.geo.strategy import copy_state
from isthmus.log import get_logger
from isthmus.parallel.rendezvous import store_address

if TYPE_CHECKING:
    from torchft import Manager

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""The Lighthouse's address, ``http://HOST:PORT`` (torchft's own variable)."""
DC_INDEX_ENV = "ISTHMUS_DC_INDEX"
"""This process's datacenter, 0 .. geo.datacenters - 1 (the emulator sets it for every rank)."""
TIMEOUT_S = 60
"""Collectives, commit votes and recovery transfers (torchft's TORCHFT_TIMEOUT_SEC overrides)."""
QUORUM_TIMEOUT_S = 1800
"""How long an outer sync waits for a quorum: a restarted datacenter waits up to inner_steps
steps for the others' next sync (TORCHFT_QUORUM_TIMEOUT_SEC overrides)."""
START_WAIT_S = 120
"""How long a fresh start waits for every datacenter to join its first quorum before it trains
with those present (ISTHMUS_FT_START_WAIT_SEC overrides)."""
START_WAIT_ENV = "ISTHMUS_FT_START_WAIT_SEC"
_START_POLL_S = 0.5
"""Between two quorum requests of a fresh start waiting for the others."""


def is_enabled(cfg: GeoConfig) -> bool:
    return cfg.fault_tolerant


def layout_world(cfg: GeoConfig, world: int) -> int:
    """Ranks of the whole run given this job's ``world``: every datacenter's under geo.fault_tolerant."""
    return world * cfg.datacenters if is_enabled(cfg) else world


def check_config(cfg: GeoConfig) -> None:
    """The rules ``geo.fault_tolerant`` adds; ConfigError names the key, the value and the rule."""
    if cfg.sync not in ("diloco", "streaming_diloco"):
        raise ConfigError("geo.fault_tolerant", True, f"needs geo.sync = diloco or streaming_diloco, not {cfg.sync!r}")
    if cfg.datacenters < 2:
        raise ConfigError("geo.datacenters", cfg.datacenters, "must be at least 2 with geo.fault_tolerant")
    wire = resolved_outer_dtype(cfg)
    if wire != "fp32":
        raise ConfigError(
            "geo.outer_dtype",
            cfg.outer_dtype,
            f'resolves to {wire}; geo.fault_tolerant sends fp32 only (set geo.outer_dtype = "fp32")',
        )
    if cfg.sync == "streaming_diloco" and cfg.overlap_steps >= max(1, cfg.inner_steps // cfg.fragments):
        raise ConfigError(
            "geo.overlap_steps",
            cfg.overlap_steps,
            f"must be below geo.inner_steps // geo.fragments = {cfg.inner_steps // cfg.fragments} with "
            "geo.fault_tolerant: a fragment's round must end before the next one begins",
        )


@dataclass(frozen=True)
class FaultTolerantJob:
    """Where this process stands in a fault-tolerant run (read from the environment)."""

    dc_index: int
    """This process's datacenter."""
    n_dc: int
    """Datacenters of the whole run (geo.datacenters); fewer may be alive at any time."""
    lighthouse: str
    """torchft Lighthouse address, ``http://HOST:PORT``."""
    address: str
    """Address the other datacenters reach this one at (its store, manager and gloo peers)."""


def job_from_env(cfg: GeoConfig) -> FaultTolerantJob | None:
    """This process's :class:`FaultTolerantJob`, or None unless ``geo.fault_tolerant`` is set."""
    if not is_enabled(cfg):
        return None
    check_config(cfg)
    raw = os.environ.get(DC_INDEX_ENV)
    if raw is None or not raw.isdigit() or not 0 <= int(raw) < cfg.datacenters:
        raise IsthmusError(
            f"geo.fault_tolerant: {DC_INDEX_ENV} = {raw!r} must name this process's datacenter, "
            f"0 .. {cfg.datacenters - 1}"
        )
    lighthouse = os.environ.get(LIGHTHOUSE_ENV, "")
    if not lighthouse:
        raise IsthmusError(
            f"geo.fault_tolerant: set {LIGHTHOUSE_ENV}=http://HOST:PORT to a running "
            "torchft_lighthouse (--min_replicas 1)"
        )
    return FaultTolerantJob(int(raw), cfg.datacenters, lighthouse, os.environ.get("MASTER_ADDR", "127.0.0.1"))


@dataclass
class RoundRecord:
    """One outer round as this datacenter saw it."""

    step: int
    """Inner steps done (1-based count) when the round began; 0 for the joining round of a fresh start."""
    fragment: int | None
    """The fragment synced; None for a round that synced nothing (a fresh start)."""
    participants: int
    """Datacenters in the quorum."""
    contributors: int
    """Datacenters whose pseudo-gradient the outer step averaged (participants less those healing)."""
    committed: bool
    """Whether the outer step was applied (False: a collective failed; the round was dropped)."""
    healed: bool
    """Whether this datacenter received the global model from another one in this round."""


@dataclass
class _Round(_Transfer):
    step: int = 0
    healed: bool = False
    participants: int = 0
    weight: Tensor | None = None
    """Sum over the quorum of the contribution weights (1 trained, 0 healing); one element."""
    contributors: int = 0
    works_done: bool = field(default=False, repr=False)


class FaultTolerantDiLoCo(DiLoCoSync):
    """diloco / streaming_diloco whose cross-datacenter hop is a torchft Manager's fault-tolerant all-reduce."""

    def __init__(
        self, groups: GeoGroups, params: list[nn.Parameter], cfg: GeoConfig, streaming: bool, job: FaultTolerantJob
    ) -> None:
        super().__init__(groups, params, cfg, streaming)
        assert not self.lossy and self.residuals is None, "check_config allows fp32 outer gradients only"
        self.job = job
        self.history: list[RoundRecord] = []
        """Every outer round of this run, oldest first."""
        self._round_step = 0
        self._healed_step: int | None = None
        self._own_store: dist.TCPStore | None = None
        self.manager = self._build_manager()

    # -- torchft --------------------------------------------------------------------------------

    def _build_manager(self) -> Manager:
        # torchft's Rust side logs every lighthouse tick at info; keep it to warnings unless asked.
        os.environ.setdefault("RUST_LOG", "warn")
        _quiet_torchft_internals()
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing.pg_transport import PGTransport

        timeout = timedelta(seconds=int(os.environ.get("TORCHFT_TIMEOUT_SEC", TIMEOUT_S)))
        pg = ProcessGroupGloo(timeout=timeout)
        store_addr, store_port = self._store_address()
        manager = Manager(
            pg=pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=1,
            # Quorum and healing before the round's collectives, on this thread (DiLoCo needs sync).
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=QUORUM_TIMEOUT_S),
            connect_timeout=timeout,
            rank=self.groups.intra_rank,
            world_size=self.groups.intra_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=self.job.lighthouse,
            replica_id=f"isthmus_dc{self.job.dc_index}",
            hostname=self.job.address,
            # Recovery state travels over the same gloo group as the outer gradients (bound to the
            # WAN interface like them), not torchft's default HTTP server on the host name.
            checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")),
            # Every datacenter starts from the same seed: nothing to copy at step 0.
            init_sync=False,
        )
        manager.register_state_dict_fn("isthmus_diloco", self._load_recovery_state, self._recovery_state)
        return manager

    def _store_address(self) -> tuple[str, int]:
        """The datacenter's TCPStore (torchrun's, or one of our own when it runs one rank alone)."""
        if dist.is_initialized():
            return store_address()
        self._own_store = dist.TCPStore(self.job.address, 0, is_master=True, wait_for_workers=False)
        return self.job.address, self._own_store.port

    def _recovery_state(self) -> dict[str, Any]:
        """What a datacenter behind the others receives (this rank's shards): called on the sender."""
        return {
            "step": self._round_step,
            "snapshot": [s.clone() for frag in self.snapshot for s in frag],
            "momentum": [m.clone() for frag in self.momentum for m in frag],
        }

    def _load_recovery_state(self, state: dict[str, Any]) -> None:
        copy_state("snapshot", [s for frag in self.snapshot for s in frag], state["snapshot"])
        copy_state("momentum", [m for frag in self.momentum for m in frag], state["momentum"])
        self._healed_step = int(state["step"])

    def _enter_quorum(self, t: int) -> bool:
        """Join the quorum of live datacenters for a round at inner step ``t``; True when this one healed."""
        self._round_step, self._healed_step = t, None
        self.manager.start_quorum()
        return self._healed_step is not None

    def _group(self, scope: Scope) -> dist.ProcessGroup:
        assert scope != "inter", "the cross-datacenter hop goes through the torchft manager"
        return super()._group(scope)

    def _ft_all_reduce(self, t: Tensor, n: int) -> Any:
        """Sum ``t`` over the quorum (in place when it succeeds; failures surface in should_commit)."""
        from torch.distributed import ReduceOp

        if n > 1:
            self._count("inter", accounting.all_reduce_bytes(t.numel() * t.element_size(), n))
        return self.manager.allreduce(t, reduce_op=ReduceOp.SUM)

    # -- one round ------------------------------------------------------------------------------

    def join(self, params: list[nn.Parameter]) -> int:
        """Enter the quorum before the first step; returns the step to train from.

        Blocks until the live datacenters meet (a restarted one: until their next outer sync; a
        fresh start: until every datacenter is there, up to ``START_WAIT_S``).
        """
        self._check(params)
        if not self._enter_first_quorum():
            # Everyone in the quorum is as far as this datacenter: a fresh start, nothing to sync.
            committed = self.manager.should_commit()
            self._record(RoundRecord(0, None, self.manager.num_participants(), 0, committed, healed=False))
            return 0
        t = self._healed_step
        assert t is not None and t > 0
        for f in self.syncs_at(t - 1):  # the round the others are in
            rnd = self._start_round(f, t, params, contribute=False)
            self.pending.append(rnd)
            self._apply(rnd, params)
        get_logger().info("geo: datacenter %d rejoined at step %d with the global model", self.job.dc_index, t)
        return t

    def _enter_first_quorum(self) -> bool:
        """Join the first quorum; True when this datacenter healed (the others are ahead).

        A fresh start (not a restart by the launcher) asks again until every datacenter is in the
        quorum or the wait is over (see the module docstring). Every rank of the datacenter gets the
        same quorums and counts the same attempts, so all of them stop asking at the same one.
        """
        fresh = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        attempts = max(1, round(float(os.environ.get(START_WAIT_ENV, START_WAIT_S)) / _START_POLL_S))
        log = get_logger()
        for attempt in range(attempts):
            if self._enter_quorum(0):
                return True
            n = self.manager.num_participants()
            if not fresh or n >= self.job.n_dc:
                return False
            if attempt == 0:
                log.info(
                    "geo: datacenter %d waits for the other datacenters to start (%d of %d here)",
                    self.job.dc_index,
                    n,
                    self.job.n_dc,
                )
            if attempt < attempts - 1:
                time.sleep(_START_POLL_S)
        log.warning(
            "geo: datacenter %d starts with %d of %d datacenters: the others did not join within %s s",
            self.job.dc_index,
            n,
            self.job.n_dc,
            os.environ.get(START_WAIT_ENV, START_WAIT_S),
        )
        return False

    def _launch(self, f: int, t: int, params: list[nn.Parameter]) -> _Transfer:
        healed = self._enter_quorum(t)
        if healed and self._healed_step != t:
            get_logger().warning("geo: healed at step %d from a datacenter at step %d", t, self._healed_step)
        return self._start_round(f, t, params, contribute=not healed)

    def _start_round(self, f: int, t: int, params: list[nn.Parameter], contribute: bool) -> _Round:
        rnd = _Round(fragment=f, apply_at=t + self.overlap_steps, step=t, healed=not contribute)
        rnd.participants = n = self.manager.num_participants()
        for i, b in enumerate(self.fragments[f]):
            if contribute:
                local = self._local_slice(params, b)
                outer_grad = self.snapshot[f][i] - local
            else:
                outer_grad = torch.zeros_like(self.snapshot[f][i])
            rnd.works.append(self._ft_all_reduce(outer_grad, n))
            rnd.buffers.append(outer_grad)
        rnd.weight = torch.tensor([1.0 if contribute else 0.0], dtype=torch.float32, device=self.device)
        rnd.works.append(self._ft_all_reduce(rnd.weight, n))
        return rnd

    def _receive(self, tr: _Transfer) -> list[Tensor]:
        """Mean pseudo-gradient over the contributors ([] when nobody contributed or it failed)."""
        assert isinstance(tr, _Round)
        if not tr.works_done:
            for work in tr.works:
                work.wait()
            assert tr.weight is not None
            # After a failure the buffers hold whatever the broken transfer left: use none of it.
            total = 0.0 if self.manager.errored() else float(tr.weight.item())
            tr.contributors = round(total)
            tr.mean = [buf.div_(total) for buf in tr.buffers] if total > 0 else []
            tr.works, tr.works_done = [], True
        assert tr.mean is not None
        return tr.mean

    def _apply(self, tr: _Transfer, params: list[nn.Parameter]) -> None:
        """Commit (a vote inside the datacenter), then the outer step; a healed one takes the new snapshot."""
        assert isinstance(tr, _Round)
        mean = self._receive(tr)
        committed = self.manager.should_commit()
        if committed and mean:
            super()._apply(tr, params)
        else:
            self.pending.remove(tr)
        if tr.healed:
            self._take_snapshot(params)
        self._record(RoundRecord(tr.step, tr.fragment, tr.participants, tr.contributors, committed, tr.healed))

    def _take_snapshot(self, params: list[nn.Parameter]) -> None:
        """Every fragment's parameters := the global snapshot (all-gathered inside the datacenter)."""
        for f, frag in enumerate(self.fragments):
            for i, b in enumerate(frag):
                full = self._zeros(b.padded)
                self._all_gather(full, self.snapshot[f][i], "intra")
                unpack_params(full, params, b)

    def _record(self, rec: RoundRecord) -> None:
        self.history.append(rec)
        get_logger().info(
            "geo: outer round at step %d (datacenter %d): %d datacenter(s) in the quorum, %d contributed%s%s",
            rec.step,
            self.job.dc_index,
            rec.participants,
            rec.contributors,
            "" if rec.committed else ", not committed (dropped)",
            ", healed from a peer" if rec.healed else "",
        )

    def global_snapshot(self) -> Tensor:
        """This rank's shards of the global snapshot, end to end (a copy)."""
        return torch.cat([s.reshape(-1) for frag in self.snapshot for s in frag]).clone()

    def finish(self, params: list[nn.Parameter]) -> None:
        super().finish(params)
        self.manager.shutdown(wait=False)


class _DropFlightRecorderNote(logging.Filter):
    """torchft warns at every reconfiguration that it cannot reset NCCL's flight recorder, which a
    gloo group on CPU does not have: nothing to act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "NCCL flight recorder" not in record.getMessage()


def _quiet_torchft_internals() -> None:
    """Silence what torchft says about its own internals at every recovery, precisely: a note on
    NCCL's flight recorder, and the UserWarning / FutureWarning its checkpoint transport triggers in
    torch (a read-only buffer it copies anyway, a deprecated pytree check)."""
    manager_log = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _DropFlightRecorderNote) for f in manager_log.filters):
        manager_log.addFilter(_DropFlightRecorderNote())
    for category in (UserWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=r"torchft\.checkpointing\.pg_transport")


def build_fault_tolerant_sync(
    kind: str, job: FaultTolerantJob, params: list[nn.Parameter], cfg: GeoConfig, ranks_per_node: int | None = None
) -> FaultTolerantDiLoCo:
    """The strategy for one datacenter of a fault-tolerant run; this process group is that datacenter.

    Connects to the Lighthouse (its Manager starts heartbeating) but joins no quorum yet: the
    trainer calls :meth:`FaultTolerantDiLoCo.join` before the first step.
    """
    check_config(cfg)
    initialized = dist.is_initialized()
    rank, size = (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)
    # No torch group spans datacenters here: world_dp is this datacenter's, and "inter" is the
    # torchft manager's (FaultTolerantDiLoCo never hands the inter scope to torch.distributed).
    local = dist.group.WORLD if initialized else None
    groups = GeoGroups(  # (None only without a process group: one rank, where no group is used)
        world_dp=local,  # type: ignore[arg-type]
        intra=local,  # type: ignore[arg-type]
        inter=local,  # type: ignore[arg-type]
        dc_index=job.dc_index,
        n_dc=job.n_dc,
        intra_rank=rank,
        intra_size=size,
        rank=job.dc_index * size + rank,
        ranks_per_node=ranks_per_node,
    )
    sync = FaultTolerantDiLoCo(groups, list(params), cfg, streaming=kind == "streaming_diloco", job=job)
    get_logger().info(
        "geo sync %s (fault tolerant, torchft): datacenter %d of %d, %d rank(s), lighthouse %s",
        kind,
        job.dc_index,
        job.n_dc,
        size,
        job.lighthouse,
    )
    return sync


@dataclass
class Lighthouse:
    """A torchft Lighthouse in this process (tests; a real run starts ``torchft_lighthouse``)."""

    server: Any
    address: str
    """``http://HOST:PORT`` for TORCHFT_LIGHTHOUSE."""

    def shutdown(self) -> None:
        self.server.shutdown()


def start_lighthouse(
    host: str = "127.0.0.1", port: int = 0, heartbeat_timeout_ms: int = 5000, join_timeout_ms: int = 10000
) -> Lighthouse:
    """Serve a Lighthouse on ``host:port`` that forms quorums of any size from 1 up.

    ``heartbeat_timeout_ms`` is how long a silent datacenter keeps its place (the survivors' next
    sync waits that long after a death); ``join_timeout_ms`` how long a quorum waits for live
    datacenters that have not asked yet.
    """
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind=f"{host}:{port}",
        min_replicas=1,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    # address() names the machine's host name, which need not resolve where the datacenters run.
    return Lighthouse(server, f"http://{host}:{server.address().rsplit(':', 1)[1]}")
