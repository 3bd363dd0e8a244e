"""`GeoGroups`: the three process groups of a multi-datacenter data-parallel run.

Ranks are laid out datacenter-major: ``rank = dc * ranks_per_dc + local``. ``intra`` joins the
ranks of one datacenter, ``inter`` the ranks with the same local index in every datacenter (one per
datacenter, the WAN hop), ``world_dp`` all of them (the flat baseline).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from isthmus.errors import ConfigError


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

    @property
    def world_size(self) -> int:
        return self.n_dc * self.intra_size


def build_geo_groups(n_dc: int, ranks_per_dc: int, ranks_per_node: int | None = None) -> GeoGroups:
    """Create the intra, inter and world_dp groups from the default group (a collective call).

    Every rank creates every group in the same order, as ``dist.new_group`` requires. ``world_dp``
    is a new group rather than the default one so that the trainer's own collectives on the default
    group (loss logging, checkpoints) never queue behind an asynchronous WAN transfer.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if n_dc * ranks_per_dc != world:
        raise ConfigError(
            "geo.datacenters", n_dc, f"times {ranks_per_dc} ranks per datacenter must equal the world size {world}"
        )
    dc, local = divmod(rank, ranks_per_dc)
    world_dp = dist.new_group(list(range(world)))
    intra = inter = None
    for d in range(n_dc):
        group = dist.new_group([d * ranks_per_dc + j for j in range(ranks_per_dc)])
        if d == dc:
            intra = group
    for j in range(ranks_per_dc):
        group = dist.new_group([d * ranks_per_dc + j for d in range(n_dc)])
        if j == local:
            inter = group
    assert intra is not None and inter is not None
    return GeoGroups(
        world_dp=world_dp, intra=intra, inter=inter, dc_index=dc, n_dc=n_dc, intra_rank=local,
        intra_size=ranks_per_dc, rank=rank, ranks_per_node=ranks_per_node,
    )
