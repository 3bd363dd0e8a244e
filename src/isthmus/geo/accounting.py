"""Bytes sent per link tier (intra_node, intra_dc, wan): what each collective puts on which link.

How a collective is counted: every collective is taken to be a ring over its group in group-rank
order (the bandwidth-optimal schedule of the alpha-beta model, and what NCCL and gloo run for large
messages). In a ring of ``n`` ranks each rank sends only to the next one, so this rank's bytes go
on the link to ``ring_next``, and a rank sends

- all-reduce of M bytes:          2 (n - 1) / n * M
- reduce-scatter of M bytes in:      (n - 1) / n * M
- all-gather of M bytes out:         (n - 1) / n * M

(floored to whole bytes). The tier is that of the link to the next rank: ``wan`` when it is in
another datacenter, ``intra_node`` when it is on the same machine (only if ranks per node are
known), else ``intra_dc``. A flat all-reduce over all ranks therefore puts the WAN share on the
last rank of each datacenter only; sum :func:`total_over_ranks` for what crossed each tier.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from isthmus.geo.groups import GeoGroups

Tier = Literal["intra_node", "intra_dc", "wan"]
Scope = Literal["world", "intra", "inter"]
TIERS: tuple[Tier, ...] = ("intra_node", "intra_dc", "wan")


def all_reduce_bytes(nbytes: int, n: int) -> int:
    return 2 * (n - 1) * nbytes // n


def reduce_scatter_bytes(in_bytes: int, n: int) -> int:
    return (n - 1) * in_bytes // n


def all_gather_bytes(out_bytes: int, n: int) -> int:
    return (n - 1) * out_bytes // n


def scope_size(groups: GeoGroups, scope: Scope) -> int:
    return {"world": groups.world_size, "intra": groups.intra_size, "inter": groups.n_dc}[scope]


def ring_next(groups: GeoGroups, scope: Scope) -> int:
    """Global rank this rank sends to in a ring over ``scope`` (group-rank order)."""
    k = groups.intra_size
    if scope == "world":
        return groups.global_rank(*divmod((groups.rank + 1) % groups.world_size, k))
    if scope == "intra":
        return groups.global_rank(groups.dc_index, (groups.intra_rank + 1) % k)
    return groups.global_rank((groups.dc_index + 1) % groups.n_dc, groups.intra_rank)


def link_tier(groups: GeoGroups, dst: int) -> Tier:
    """Tier of the link from this rank to global rank ``dst``."""
    dc, replica = groups.locate(dst)
    if dc != groups.dc_index:
        return "wan"
    node = groups.ranks_per_node
    if node is None:
        return "intra_dc"
    if groups.grid is None:  # replica indices are local ranks of the datacenter
        same = replica // node == groups.intra_rank // node
    else:  # consecutive global ranks share a machine
        same = dst // node == groups.global_rank(groups.dc_index, groups.intra_rank) // node
    return "intra_node" if same else "intra_dc"


def new_counter() -> dict[str, int]:
    return {tier: 0 for tier in TIERS}


def bytes_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Per-tier bytes sent between two copies of a counter (e.g. for one step's metrics)."""
    return {tier: after[tier] - before.get(tier, 0) for tier in after}


def total_over_ranks(bytes_sent: dict[str, int], group: dist.ProcessGroup | None = None) -> dict[str, int]:
    """Sum of every rank's counter (a collective on ``group``): what crossed each tier in total."""
    t = torch.tensor([bytes_sent[tier] for tier in TIERS], dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(t, group=group)
    return dict(zip(TIERS, t.tolist()))


def format_bytes(n: int) -> str:
    """Human-readable size in binary units: 0 B, 12.0 KiB, 3.4 GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
