"""`GeoRun`: what the trainer asks of a run across datacenters, answered once from the config.

The training loop is the same for every layout. It asks the run where its files go, which
data-parallel rank this process is, its share of each batch's tokens, and what each step and the
whole run sent over which links. The run owns the strategy that keeps the datacenters' replicas in
step (``geo.sync``, its `sync`) and joins each optimizer step as one of the trainer's step hooks
(`isthmus.train.hooks.StepHooks`): it reduces gradients after backward, syncs after the optimizer
step, and finishes the strategy after the last step. Two answers exist:

- `GeoRun`: the run is one job; every rank of the layout is in this process group (one datacenter,
  or several joined by ``geo.sync`` or by pipeline stages, ``geo.dc_axis = pp``).
- `DatacenterJob`: ``geo.fault_tolerant``; this process group is one datacenter, and the others are
  separate jobs joined by torchft (:mod:`isthmus.geo.fault`). Datacenters may leave and rejoin.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from isthmus.config import GeoConfig, MetricsConfig
from isthmus.geo.accounting import TIERS, bytes_delta, format_bytes, new_counter, total_over_ranks
from isthmus.geo.fault import FaultTolerantDiLoCo, FaultTolerantJob, build_fault_tolerant_sync, job_from_env
from isthmus.geo.groups import build_geo_groups
from isthmus.geo.strategy import GeoSync
from isthmus.geo.sync import build_geo_sync
from isthmus.layout.choices import DILOCO_SYNCS
from isthmus.layout.dims import MESH_DIMS, Meshes, ParallelDims
from isthmus.log import get_logger
from isthmus.parallel.boundary_codec import BoundaryCodec, compress_stage
from isthmus.parallel.early_recv import EarlyRecv
from isthmus.parallel.pipeline import after_each_step, count_cross_dc_sends, crosses_datacenters, local_stages
from isthmus.parallel.striped import stripe_groups, stripe_stage
from isthmus.parallel.timeshare import TimeShare, turn_groups


def build_geo_run(cfg: GeoConfig) -> GeoRun:
    """This process's run: one datacenter's job under ``geo.fault_tolerant`` (read from the
    environment, see :func:`isthmus.geo.fault.job_from_env`), else the whole run."""
    job = job_from_env(cfg)
    return GeoRun(cfg) if job is None else DatacenterJob(cfg, job)


class GeoRun:
    """A run that is one job: this process group holds every rank of the layout."""

    whole_run = True
    """Whether this process group holds every rank of the layout (and so builds its device mesh)."""

    def __init__(self, cfg: GeoConfig) -> None:
        self.cfg = cfg
        self.sync: GeoSync | None = None
        """The cross-datacenter strategy (``geo.sync``) once `build_sync` made it; None for ``none``."""
        self.pipeline_wan: dict[str, int] | None = None
        """``geo.dc_axis = pp``: the bytes this rank's stages sent to another datacenter (wan tier only)."""
        self._sync_sent_before: dict[str, int] = {}
        self.striped = {"striped": 0}
        """Cross-datacenter pipeline transfers this rank split over ``geo.wan_streams`` connections."""
        self._pipeline_sent_before: dict[str, int] = {}
        self.time_share: TimeShare | None = None
        """``geo.wan_schedule = time_shared``: this rank's turns on the WAN, once `wire_pipeline` made them."""
        self.early_recv: EarlyRecv | None = None
        """``geo.pp_early_recv``: this rank's cross-datacenter receives posted ahead, once `wire_pipeline` made them."""
        self.sums_per_round = False
        """Whether the trainer sums the steps' losses and counters over ranks once per outer round
        (DiLoCo across datacenters: no inner step waits on the WAN) rather than every step."""
        self.bytes_by_tier: dict[str, int] = {}
        """What the whole run sent by link tier, summed over ranks once `finish` ran (empty without
        cross-datacenter traffic)."""

    # -- where this process stands ---------------------------------------------------------------

    def run_dir(self, base: Path) -> Path:
        """Where this job writes its files, given ``train.run_dir``."""
        return base

    def layout_world(self, world: int) -> int:
        """Ranks of the whole run, given this job's ``world``: what the layout is checked against."""
        return world

    def dp_rank(self, mesh_dp_rank: int, rank: int, world: int) -> int:
        """This process's data-parallel rank in the whole run (which slice of each batch it takes)."""
        return mesh_dp_rank

    def replica_key(self, n_dc: int, rank: int, world: int) -> str:
        """ "dc<d>" for datacenter d > 0 under DiLoCo, whose datacenters hold models of their own
        between outer steps (see `TrainState.replica`); "" where every replica agrees."""
        if self.cfg.sync not in ("diloco", "streaming_diloco") or n_dc == 1:
            return ""
        dc = rank // (world // n_dc)
        return f"dc{dc}" if dc else ""

    def metrics_config(self, mcfg: MetricsConfig) -> MetricsConfig:
        """The ``[metrics]`` section this job logs with."""
        return mcfg

    def tokens_per_step(self, batch_tokens: int) -> int:
        """The tokens of each global batch that this job computes."""
        return batch_tokens

    # -- what moves between datacenters ----------------------------------------------------------

    def build_sync(self, params: list[nn.Parameter], dims: ParallelDims, world: int) -> GeoSync | None:
        """The cross-datacenter strategy (``geo.sync``), which then does all data-parallel
        communication; None for ``none``. A collective: every rank builds every geo group."""
        if self.cfg.sync == "none":
            return None
        # The mesh puts dc outermost, so datacenter i holds one contiguous block of ranks; the
        # emulator's launcher orders ranks the same way.
        grids = geo_grids(dims.datacenters, dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
        replicas = len(grids[0][0])
        groups = build_geo_groups(
            dims.datacenters, replicas, ranks_per_node=_local_world(world), grids=grids, streams=self.cfg.wan_streams
        )
        get_logger().info(
            "geo: %s across %d datacenters of %d ranks (%d replica(s) of each model part)",
            self.cfg.sync,
            dims.datacenters,
            world // dims.datacenters,
            replicas,
        )
        self.sync = build_geo_sync(self.cfg.sync, groups, params, self.cfg)
        if self.cfg.sync in DILOCO_SYNCS and dims.datacenters > 1:
            self.sums_per_round = True
        return self.sync

    def wire_pipeline(self, schedule: Any, pp: int, mesh: Meshes | None) -> None:
        """``geo.dc_axis = pp``: count the activations (and their gradients) that this rank's
        pipeline stages send to a stage in another datacenter; with ``geo.pp_compression`` send them
        encoded (and count the encoded bytes); with ``geo.wan_streams > 1`` split
        those transfers over that many connections, and with ``geo.wan_schedule = time_shared``
        let the pipelines take the link in turn. A collective (the stripe and turn groups)."""
        if self.cfg.dc_axis != "pp" or self.cfg.datacenters == 1 or schedule is None:
            return
        self.pipeline_wan = new_counter()  # only its wan tier is counted
        compressed = self.cfg.pp_compression != "none"
        if not compressed:
            count_cross_dc_sends(schedule, pp, self.cfg.datacenters, self.pipeline_wan)
        if (
            self.cfg.wan_streams == 1
            and self.cfg.wan_schedule == "fair"
            and not compressed
            and not self.cfg.pp_early_recv
        ):
            return
        assert mesh is not None  # pp > 1 has a mesh
        ranks = mesh.root.mesh
        if self.cfg.wan_streams > 1:
            # Every pipeline's ranks (the pp dimension of the mesh), again wan_streams - 1 times.
            pipelines = ranks.movedim(MESH_DIMS.index("pp"), -1).reshape(-1, pp).tolist()
            extra = stripe_groups(pipelines, self.cfg.wan_streams)
            for st in local_stages(schedule):
                assert st.group is not None  # the stage was built on the mesh's pp group
                streams = [st.group, *(g[0] for g in extra)]
                stripe_stage(st, streams, self._crosses(st.group_rank, pp), self.striped)
        if compressed:
            # After striping (the payload is what is striped); its sends count the payload's bytes.
            codec = partial(BoundaryCodec, self.cfg.pp_compression, self.cfg.pp_compression_rank)
            for st in local_stages(schedule):
                make = lambda seed, grads: codec(seed=seed, stochastic=grads)  # noqa: E731
                compress_stage(st, make, self._crosses(st.group_rank, pp), self.pipeline_wan)
        if self.cfg.wan_schedule == "time_shared":
            self._time_share(schedule, ranks, pp)
        elif self.cfg.pp_early_recv:
            # Outermost: it posts whatever striping and compression made of each receive.
            early = EarlyRecv(schedule._n_microbatches)
            for st in local_stages(schedule):
                early.wrap_stage(st, self._crosses(st.group_rank, pp))
            after_each_step(schedule, early.check)
            self.early_recv = early

    def _crosses(self, group_rank: int, pp: int) -> Any:
        return partial(crosses_datacenters, group_rank, pp=pp, datacenters=self.cfg.datacenters)

    def _time_share(self, schedule: Any, ranks: torch.Tensor, pp: int) -> None:
        """``geo.wan_schedule = time_shared``: the pipelines (every data-parallel and context-parallel
        replica) that hold the same pipeline and tensor-parallel rank take the WAN in turn, in
        replica order; the group that passes the turn lies in one datacenter. A collective."""
        by_stage = ranks.movedim((MESH_DIMS.index("pp"), MESH_DIMS.index("tp")), (0, 1))
        lists = by_stage.reshape(by_stage.shape[0] * by_stage.shape[1], -1).tolist()
        if len(lists[0]) == 1:
            return  # one pipeline: nobody to take turns with
        group = turn_groups(lists)
        assert group is not None  # every rank is in one list
        share = TimeShare(group, schedule._n_microbatches)
        for st in local_stages(schedule):
            share.wrap_stage(st, self._crosses(st.group_rank, pp))
        after_each_step(schedule, share.flush)
        self.time_share = share

    def join(self, params: list[nn.Parameter]) -> int:
        """Meet the other datacenters before the first step; returns the step to train from
        (0: from where this process stands)."""
        return 0

    def step_counters(self) -> list[int]:
        """This rank's bytes sent since the previous call, for the trainer to sum over ranks in the
        step's loss all-reduce (one collective a step instead of two: across a WAN each is a round
        trip or more): the link tiers of ``geo.sync``, then the pipeline's WAN bytes."""
        out: list[int] = []
        if self.sync is not None:
            delta = bytes_delta(self._sync_sent_before, self.sync.bytes_sent)
            self._sync_sent_before = dict(self.sync.bytes_sent)
            out += [delta[tier] for tier in TIERS]
        if self.pipeline_wan is not None:
            out.append(bytes_delta(self._pipeline_sent_before, self.pipeline_wan)["wan"])
            self._pipeline_sent_before = dict(self.pipeline_wan)
        return out

    def step_metrics(self, totals: Sequence[int]) -> dict[str, int]:
        """What the step just taken sent, from `step_counters` summed over ranks: ``<tier>_bytes``
        per link tier from ``geo.sync`` (the WAN share is the point), ``wan_bytes`` from a pipeline
        across datacenters."""
        values = iter(totals)
        out: dict[str, int] = {}
        if self.sync is not None:
            out.update({f"{tier}_bytes": int(next(values)) for tier in TIERS})
        if self.pipeline_wan is not None:
            out["wan_bytes"] = int(next(values))
        return out

    # -- the trainer's step hooks (`isthmus.train.hooks.StepHooks`) --------------------------------

    def begin_step(self, step: int) -> None:
        """Nothing: the strategy acts once the gradients exist."""

    def span(self, what: str) -> AbstractContextManager[Any]:
        """Nothing: the run times no op of its own."""
        return nullcontext()

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        """``geo.sync``'s gradient reduction (it does all data-parallel communication when set)."""
        if self.sync is not None:
            self.sync.reduce_gradients(params)

    def wait(self, work: Any, name: str, inner: Callable[[Any, str], None]) -> None:
        """The plain wait: nothing to do meanwhile."""
        inner(work, name)

    def after_optimizer_step(self, step: int, params: list[nn.Parameter]) -> None:
        """``geo.sync``'s outer step or transfers, after optimizer step number ``step`` (1-based)."""
        if self.sync is not None:
            self.sync.after_optimizer_step(step - 1, params)

    def end_step(self, step: int) -> dict[str, Any]:
        """What the outer round that ended with the step just taken says (called at once after the
        step, unlike `step_metrics`, whose sums arrive a step later): ``dc_quorum`` under
        ``geo.fault_tolerant``."""
        return {}

    def finish(self, params: list[nn.Parameter]) -> None:
        """After the last step: apply transfers still in flight, log what the whole run sent, and
        keep it by link tier in `bytes_by_tier`. A collective."""
        by_tier: dict[str, int] = {}
        if self.sync is not None:
            self.sync.finish(params)
            by_tier = total_over_ranks(self.sync.bytes_sent)
            get_logger().info(
                "geo %s sent %s", self.cfg.sync, ", ".join(f"{format_bytes(n)} {tier}" for tier, n in by_tier.items())
            )
        if self.pipeline_wan is not None:
            by_tier = {"wan": total_over_ranks(self.pipeline_wan)["wan"]}
            get_logger().info(
                "pipeline across %d datacenters sent %s over the WAN (activations and their gradients)",
                self.cfg.datacenters,
                format_bytes(by_tier["wan"]),
            )
        if self.cfg.wan_streams > 1:
            get_logger().info(
                "geo.wan_streams = %d: this rank split %d pipeline transfer(s) and %d sync collective(s) across datacenters",
                self.cfg.wan_streams,
                self.striped["striped"],
                self.sync.striped if self.sync is not None else 0,
            )
        if self.early_recv is not None:
            get_logger().info(
                "geo.pp_early_recv: this rank posted %d receive(s) from another datacenter ahead",
                self.early_recv.posted,
            )
        if self.time_share is not None:
            held = sorted(span for t in self.time_share.turns for span in t.held)
            get_logger().info(
                "geo.wan_schedule = time_shared: this rank took %d turn(s) on the WAN, held (posted, done, unix s): %s",
                len(held),
                " ".join(f"{a:.4f},{b:.4f}" for a, b in held),
            )
        self.bytes_by_tier = by_tier


class DatacenterJob(GeoRun):
    """One datacenter's job of a fault-tolerant run (``geo.fault_tolerant``): this process group
    is that datacenter; the layout, the batch and the data-parallel ranks are still the whole run's."""

    whole_run = False

    def __init__(self, cfg: GeoConfig, job: FaultTolerantJob) -> None:
        super().__init__(cfg)
        self.job = job
        self.ft_sync: FaultTolerantDiLoCo | None = None
        self._rounds_seen = 0

    def run_dir(self, base: Path) -> Path:
        return base / f"dc{self.job.dc_index}"

    def layout_world(self, world: int) -> int:
        return world * self.job.n_dc

    def dp_rank(self, mesh_dp_rank: int, rank: int, world: int) -> int:
        return self.job.dc_index * world + rank  # datacenter-major, as the mesh lays them out

    def replica_key(self, n_dc: int, rank: int, world: int) -> str:
        return ""  # a fault-tolerant job is one datacenter, and does not checkpoint

    def metrics_config(self, mcfg: MetricsConfig) -> MetricsConfig:
        if not mcfg.jsonl:
            return mcfg
        path = Path(mcfg.jsonl)  # each datacenter's job writes its own records
        return replace(mcfg, jsonl=str(path.with_name(f"{path.stem}.dc{self.job.dc_index}{path.suffix}")))

    def tokens_per_step(self, batch_tokens: int) -> int:
        return batch_tokens // self.job.n_dc  # this datacenter's share of each batch

    def build_sync(self, params: list[nn.Parameter], dims: ParallelDims, world: int) -> GeoSync | None:
        self.ft_sync = build_fault_tolerant_sync(
            self.cfg.sync, self.job, params, self.cfg, ranks_per_node=_local_world(world)
        )
        self.sync = self.ft_sync
        return self.sync

    def join(self, params: list[nn.Parameter]) -> int:
        # One that (re)starts late gets the global model and continues at the others' step.
        assert self.ft_sync is not None, "build_sync first"
        step = self.ft_sync.join(params)
        self._rounds_seen = len(self.ft_sync.history)
        return step

    def end_step(self, step: int) -> dict[str, Any]:
        assert self.ft_sync is not None
        history = self.ft_sync.history
        if len(history) > self._rounds_seen:
            self._rounds_seen = len(history)
            return {"dc_quorum": history[-1].participants}  # datacenters in this step's outer round
        return {}


def _local_world(world: int) -> int:
    """Ranks per machine (the launcher's LOCAL_WORLD_SIZE; ``world`` when not launched)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


def geo_grids(dc: int, pp: int, dp_replicate: int, dp_shard: int, cp: int, tp: int) -> list[list[list[int]]]:
    """The geo grids of the mesh (dc, pp, dp_replicate, dp_shard, cp, tp), laid out row-major as
    `ParallelDims.build_mesh` lays out ranks: for each part of the model a rank holds (pp stage, tp
    shard, and FSDP shard over dp_shard x cp), grid[d][j] is the global rank of replica j in
    datacenter d (see `isthmus.geo.groups`). Replicas are dp_replicate x cp without FSDP (cp ranks
    hold the same parameters), dp_replicate alone with it (FSDP shards over dp_shard x cp)."""
    ranks = torch.arange(dc * pp * dp_replicate * dp_shard * cp * tp).reshape(dc, pp, dp_replicate, dp_shard * cp, tp)
    if dp_shard == 1:  # the cp ranks are replicas
        ranks = ranks.reshape(dc, pp, dp_replicate * cp, 1, tp)
    return [ranks[:, s, :, f, t].tolist() for s in range(pp) for f in range(ranks.shape[3]) for t in range(tp)]
