"""`ParallelDims`: the one source of truth for the parallel degrees of a run, and its device mesh.

Mesh dims, outermost first: ``dc, pp, dp_replicate, dp_shard, cp, tp``. Tensor parallelism is
innermost because it communicates every layer (it should stay inside a node); the datacenter is
outermost because what crosses it goes over the WAN, the slowest link; pipeline parallelism comes
next because it only sends activations between neighbours. ``dc`` replicates like
``dp_replicate``: without a geo sync strategy it simply widens the replicate group.

Pure Python (the planner and the launcher use it without torch); :meth:`ParallelDims.build_mesh`
imports torch when called.
The config arrives as the protocols of :mod:`isthmus.layout.sections` (``ParallelConfig`` and
``JobConfig`` satisfy them): isthmus.config imports this package, not the other way round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from isthmus.errors import ConfigError
from isthmus.layout import rules
from isthmus.layout.sections import LayoutConfig, ParallelSection

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("dc", "pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    datacenters: int = 1
    """Datacenters the replicas span (``geo.datacenters`` with ``geo.dc_axis = dp``; the mesh's
    ``dc`` dimension); each holds world_size / datacenters ranks."""
    ep: int = 1
    """Expert-parallel degree of the MoE layers, folded over dp_shard x cp (not a dimension of its own:
    see `build_mesh`)."""

    def degrees(self) -> tuple[int, ...]:
        """The mesh's sizes, in :data:`MESH_DIMS` order."""
        return (self.datacenters, self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    def __post_init__(self) -> None:
        for name, size in zip(MESH_DIMS, self.degrees(), strict=True):
            if size < 1:
                key = "geo.datacenters" if name == "dc" else f"parallel.{name}"
                raise ConfigError(key, size, "must be at least 1")
        product = math.prod(self.degrees())
        if product != self.world_size:
            dc = f"{self.datacenters}*" if self.datacenters > 1 else ""
            raise ConfigError(
                "parallel.nproc",
                self.world_size,
                f"must equal {'datacenters*' if self.datacenters > 1 else ''}dp_replicate*dp_shard*cp*tp*pp = "
                f"{dc}{self.dp_replicate}*{self.dp_shard}*{self.cp}*{self.tp}*{self.pp} = {product}",
            )

    @classmethod
    def from_config(cls, p: ParallelSection, world_size: int | None = None, datacenters: int = 1) -> ParallelDims:
        world = p.nproc if world_size is None else world_size
        return cls(p.dp_replicate, p.dp_shard, p.cp, p.tp, p.pp, world, datacenters, p.ep)

    @property
    def replicate(self) -> int:
        """Full replicas: datacenters times replicas inside each."""
        return self.datacenters * self.dp_replicate

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different slices of each global batch are computed."""
        return self.replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        """Replicas exist (inside a datacenter or across datacenters)."""
        return self.replicate > 1

    @property
    def dc_enabled(self) -> bool:
        return self.datacenters > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def grad_sync_degree(self) -> int:
        """Ranks that hold replicas of the same parameters and must average gradients (dp x cp)."""
        return self.dp * self.cp

    def build_mesh(self, device_type: str) -> Meshes:
        """One named mesh over all ranks, plus flattened views used by data parallelism and the loss.

        - ``replicate``: (dc, dp_replicate), the replicas;
        - ``dp``: (dc, dp_replicate, dp_shard), which batch slice a rank computes;
        - ``dp_shard_cp``: (dp_shard, cp), what FSDP shards over (context-parallel ranks hold the
          same parameters, so they share the shards and the gradient reduction);
        - ``dp_cp``: (dc, dp_replicate, dp_shard, cp), the ranks a loss is averaged over.

        With ep > 1, ``experts``: dp_cp unflattened into (``e_replicate``, ``efsdp``, ``ep``), sizes
        (dc x dp_replicate, dp_shard x cp / ep, ep), and with tp > 1 a fourth, ``etp`` (tp's ranks). Expert parallelism folds over dp_shard x cp as
        torchtitan's does: ``ep`` is a block of ep consecutive ranks of dp_shard_cp, which hold
        different experts (and different data); ``efsdp`` are the ranks of dp_shard_cp holding the same
        experts, over which FSDP shards them, and ``e_replicate`` replicates them as dp_replicate
        does the dense part. Unflattened from the root mesh, so FSDP accepts DTensors on it.
        """
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, self.degrees(), mesh_dim_names=MESH_DIMS)
        flat = {
            "replicate": mesh["dc", "dp_replicate"]._flatten("replicate"),
            "dp": mesh["dc", "dp_replicate", "dp_shard"]._flatten("dp"),
            "dp_shard_cp": mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
            "dp_cp": mesh["dc", "dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
        }
        experts = None
        if self.ep_enabled:
            sizes = (self.replicate, self.dp_shard * self.cp // self.ep, self.ep)
            if self.tp_enabled:
                # Experts sharded by expert over ep and by hidden unit over tp: a 2-D (ep, etp) mesh,
                # etp being tp's ranks, on the same root as the dense part's tp.
                dp_cp_tp = mesh["dc", "dp_replicate", "dp_shard", "cp", "tp"]._flatten("dp_cp_tp")
                names = ("e_replicate", "efsdp", "ep", "etp")
                experts = dp_cp_tp._unflatten(0, (*sizes, self.tp), names)
            else:
                experts = flat["dp_cp"]._unflatten(0, sizes, ("e_replicate", "efsdp", "ep"))
        return Meshes(mesh, flat, experts)


class Meshes:
    """The run's root mesh and its flattened views, looked up by name.

    torch asks callers to keep flattened meshes themselves rather than slice them from the root.
    A 2-D view over (dp_replicate, dp_shard_cp) for HSDP is sliced from the root mesh.
    """

    def __init__(self, root: DeviceMesh, flat: dict[str, DeviceMesh], experts: DeviceMesh | None = None) -> None:
        self.root, self.flat = root, flat
        self.experts = experts
        """(e_replicate, efsdp, ep) when expert parallelism is on (see `ParallelDims.build_mesh`)."""

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(names, str) and names in self.flat:
            return self.flat[names]
        return self.root[names]


FILL = -1
"""A data-parallel degree of -1 takes whatever the other degrees leave of the world size."""


def fill_data_parallel(p: ParallelSection, world_size: int, datacenters: int = 1) -> None:
    """Replace a data-parallel degree of -1 by what the named degrees leave of ``world_size``, in place.

    As torchtitan's ``-1``: ``--parallel.nproc 4 --parallel.tp 2`` alone runs dp 2 x tp 2, and
    ``--parallel.dp_shard 2`` on two ranks does not inherit a replicate degree it has no room for.
    ``dp_shard = -1`` fills first (FSDP over every rank left); otherwise ``dp_replicate = -1`` does
    (the default), except that with ``ep > 1`` and dp_shard left at 1 dp_shard fills (expert
    parallelism folds over dp_shard x cp); a -1 with nothing left to fill is 1. ``datacenters``
    multiply the named degrees.
    """
    if p.ep > 1 and p.dp_shard == 1 and p.dp_replicate == FILL and p.cp % p.ep:
        for name, value in (("dp_shard", FILL), ("dp_replicate", 1)):
            setattr(p, name, value)
    for name in ("dp_replicate", "dp_shard"):
        value = getattr(p, name)
        if value < 1 and value != FILL:
            raise ConfigError(
                f"parallel.{name}", value, f"must be at least 1, or {FILL} to fill what the other degrees leave"
            )
    filler = "dp_shard" if p.dp_shard == FILL else "dp_replicate" if p.dp_replicate == FILL else None
    if filler is None:
        return
    other = "dp_replicate" if filler == "dp_shard" else "dp_shard"
    if getattr(p, other) == FILL:
        setattr(p, other, 1)
    named = {"datacenters": datacenters, other: getattr(p, other), "cp": p.cp, "tp": p.tp, "pp": p.pp}
    product = math.prod(named.values())
    if world_size % product:
        shown = {k: v for k, v in named.items() if k != "datacenters" or datacenters > 1}
        raise ConfigError(
            "parallel.nproc",
            world_size,
            f"must be a multiple of {'*'.join(shown)} = {'*'.join(map(str, shown.values()))} = {product} "
            f"(parallel.{filler} = {FILL} fills what the other degrees leave)",
        )
    setattr(p, filler, world_size // product)


def check_layout(
    cfg: LayoutConfig,
    n_heads: int,
    n_kv_heads: int,
    n_layers: int,
    world_size: int | None = None,
    n_experts: int = 0,
    capacity_factor: float = 0.0,
) -> ParallelDims:
    """Every layout rule that needs no process, with the numbers in the message.

    ``world_size`` is the launcher's (under torchrun); by default ``parallel.nproc``. A
    data-parallel degree of -1 is filled in ``cfg`` first (`fill_data_parallel`), so the config
    written with the run states the degrees it ran with.
    """
    p, t = cfg.parallel, cfg.train
    # geo.dc_axis = pp: the datacenters hold consecutive pipeline stages. Ranks are datacenter-major
    # and pp is the outermost dimension after dc, so pp's blocks of ranks line up with them.
    dc = cfg.geo.datacenters if cfg.geo.dc_axis == "dp" else 1
    fill_data_parallel(p, p.nproc if world_size is None else world_size, datacenters=dc)
    dims = ParallelDims.from_config(p, world_size, datacenters=dc)
    rules.raise_for(rules.tensor_parallel_heads(p.tp, n_heads, n_kv_heads))
    rules.raise_for(rules.pipeline_stages(p.pp, p.pp_virtual_stages, n_layers))
    if t.seq_len % (2 * p.cp):
        raise ConfigError(
            "parallel.cp", p.cp, f"2*cp = {2 * p.cp} must divide train.seq_len = {t.seq_len} (load-balanced chunks)"
        )
    if p.cp_impl == "ulysses" and dims.cp_enabled and (n_heads // p.tp) % p.cp:
        raise ConfigError(
            "parallel.cp",
            p.cp,
            f"ulysses needs cp to divide the heads per tensor-parallel rank, n_heads/tp = {n_heads // p.tp}",
        )
    if p.sequence_parallel and not dims.tp_enabled:
        raise ConfigError("parallel.sequence_parallel", True, "needs parallel.tp > 1")
    if p.sequence_parallel and t.seq_len % (p.tp * p.cp):
        raise ConfigError(
            "parallel.sequence_parallel", True, f"tp*cp = {p.tp * p.cp} must divide train.seq_len = {t.seq_len}"
        )
    micro = dims.dp * t.grad_accum * (p.microbatches if dims.pp_enabled else 1)
    if t.batch_size % micro:
        raise ConfigError(
            "train.batch_size",
            t.batch_size,
            f"must be divisible by dp ({dims.dp}) x grad_accum ({t.grad_accum})"
            + (f" x microbatches ({p.microbatches})" if dims.pp_enabled else "")
            + f" = {micro}",
        )
    geo_sync = cfg.geo.sync != "none"
    rules.raise_for(rules.zero_stage(p.zero_stage, dims.dp_shard, dims.tp, dims.pp, dims.cp, dims.replicate, geo_sync))
    rules.raise_for(rules.expert_parallel(p.ep, dims.dp_shard, dims.cp, n_experts))
    if dims.ep_enabled and p.zero_stage == 1:
        raise ConfigError("parallel.zero_stage", 1, "ZeRO-1 (DDP) cannot hold expert-sharded weights; use 2 or 3")
    if n_experts and capacity_factor > 0 and dims.cp > 1:
        # Not built yet: which tokens a sequence's capacity keeps depends on its chunks on other ranks.
        raise ConfigError("parallel.cp", dims.cp, "is not combined with model.capacity_factor > 0 yet")
    g = cfg.geo
    if g.sync != "none":
        if not dims.dc_enabled:
            raise ConfigError("geo.sync", g.sync, "needs geo.datacenters of 2 or more")
        inner = {k: getattr(p, k) for k in ("dp_shard", "tp", "cp", "pp") if getattr(p, k) > 1}
        if g.fault_tolerant and inner:
            k, v = next(iter(inner.items()))
            raise ConfigError(
                f"parallel.{k}",
                v,
                "is not combined with geo.fault_tolerant yet: each datacenter's job runs data-parallel replicas (dp_replicate) only",
            )
        if cfg.checkpoint.every and g.fault_tolerant:
            raise ConfigError(
                "checkpoint.every",
                cfg.checkpoint.every,
                "is not combined with geo.fault_tolerant yet: a datacenter that fails rejoins from the live ones",
            )
    rules.raise_for(rules.pipeline_schedule(p.pp_schedule, p.pp, p.microbatches, p.pp_virtual_stages))
    return dims
