"""`GeoGroups`: the three process groups of a multi-datacenter data-parallel run.

Ranks are laid out datacenter-major: ``rank = dc * ranks_per_dc + local``. ``intra`` joins the
ranks of one datacenter, ``inter`` the ranks with the same local index in every datacenter (one per
datacenter, the WAN hop), ``world_dp`` all of them (the flat baseline).

With tensor or pipeline parallelism inside each datacenter, the ranks that hold the same part of
the model (same pp stage and tp shard) form one such structure of their own: a *grid* of global
ranks, ``grid[d][j]`` = replica j (dp_replicate x cp) of datacenter d. `build_geo_groups` takes
every grid, makes all their groups (every rank must create every group) and keeps this rank's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from isthmus.errors import ConfigError
from isthmus.parallel.striped import stripe_groups


@dataclass
class GeoGroups:
    world_dp: dist.ProcessGroup
    """Every data-parallel rank in every datacenter."""
    intra: dist.ProcessGroup
    """The ranks of my datacenter."""
    inter: dist.ProcessGroup
    """The ranks with my intra index, one per datacenter."""
    dc_index: int
    """My datacenter, 0 .. n_dc - 1."""
    n_dc: int
    """Number of datacenters."""
    intra_rank: int
    """My index inside my datacenter."""
    intra_size: int
    """Ranks per datacenter."""
    rank: int = 0
    """My rank in ``world_dp`` (= dc_index * intra_size + intra_rank)."""
    ranks_per_node: int | None = None
    """Ranks per machine inside a datacenter, for the intra_node byte tier; None = count all as intra_dc."""
    grid: list[list[int]] | None = None
    """Global rank of replica j of datacenter d, ``grid[d][j]``; None: ``d * intra_size + j``."""
    inter_stripes: list[dist.ProcessGroup] = field(default_factory=list)
    """With ``geo.wan_streams > 1``: ``inter`` and more groups over the same ranks, one connection
    per stripe of each inter-datacenter collective (:mod:`isthmus.parallel.striped`); else empty."""

    @property
    def world_size(self) -> int:
        return self.n_dc * self.intra_size

    def global_rank(self, dc: int, replica: int) -> int:
        return self.grid[dc][replica] if self.grid is not None else dc * self.intra_size + replica

    def locate(self, global_rank: int) -> tuple[int, int]:
        """(datacenter, replica index) of a global rank of this rank's grid."""
        if self.grid is None:
            return divmod(global_rank, self.intra_size)
        for d, row in enumerate(self.grid):
            if global_rank in row:
                return d, row.index(global_rank)
        raise ValueError(f"rank {global_rank} is not in this rank's geo grid")


def build_geo_groups(
    n_dc: int,
    ranks_per_dc: int,
    ranks_per_node: int | None = None,
    grids: list[list[list[int]]] | None = None,
    streams: int = 1,
) -> GeoGroups:
    """Create the intra, inter and world_dp groups from the default group (a collective call).

    ``grids``: one per part of the model (see the module doc), each ``n_dc`` rows of
    ``ranks_per_dc`` global ranks; None = one grid of all ranks, datacenter-major.
    Every rank creates every group in the same order, as ``dist.new_group`` requires. ``world_dp``
    is a new group rather than the default one so that the trainer's own collectives on the default
    group (loss logging, checkpoints) never queue behind an asynchronous WAN transfer. ``streams > 1``
    (``geo.wan_streams``): every inter group again, ``streams - 1`` times, one connection per stripe.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    plain = grids is None
    if grids is None:
        if n_dc * ranks_per_dc != world:
            raise ConfigError(
                "geo.datacenters", n_dc, f"times {ranks_per_dc} ranks per datacenter must equal the world size {world}"
            )
        grids = [[[d * ranks_per_dc + j for j in range(ranks_per_dc)] for d in range(n_dc)]]
    assert sorted(r for g in grids for row in g for r in row) == list(range(world)), "grids must cover every rank once"
    mine: dict[str, Any] = {}  # this rank's grid, groups and place in them
    for grid in grids:
        here = any(rank in row for row in grid)
        world_dp = dist.new_group([r for row in grid for r in row])
        if here:
            mine["grid"], mine["world_dp"] = grid, world_dp
        for d, row in enumerate(grid):
            group = dist.new_group(row)
            if rank in row:
                mine["intra"], mine["dc"], mine["local"] = group, d, row.index(rank)
        for j in range(ranks_per_dc):
            group = dist.new_group([row[j] for row in grid])
            if here and grid[mine["dc"]][j] == rank:
                mine["inter"] = group
    stripes = []
    if streams > 1:
        inter = [[row[j] for row in grid] for grid in grids for j in range(ranks_per_dc)]
        stripes = [mine["inter"]] + [g[0] for g in stripe_groups(inter, streams)]
    dc, local = int(mine["dc"]), int(mine["local"])
    return GeoGroups(
        world_dp=mine["world_dp"],
        intra=mine["intra"],
        inter=mine["inter"],
        dc_index=dc,
        n_dc=n_dc,
        intra_rank=local,
        intra_size=ranks_per_dc,
        rank=dc * ranks_per_dc + local,
        ranks_per_node=ranks_per_node,
        grid=None if plain else mine["grid"],
        inter_stripes=stripes,
    )
