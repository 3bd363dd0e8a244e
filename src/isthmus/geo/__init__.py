"""Training across datacenters joined by slow WAN links: gradient and parameter sync strategies.

``geo.sync`` picks one: flat, hierarchical, compressed (per step, :mod:`isthmus.geo.sync`),
diloco or streaming_diloco (every H steps, :mod:`isthmus.geo.diloco`). Each strategy counts the
bytes it sends per link tier (:mod:`isthmus.geo.accounting`). See :mod:`isthmus.geo.strategy`
for what the trainer calls when, and :mod:`isthmus.geo.run` for what else it asks of a run across
datacenters (one job, or one datacenter's job under ``geo.fault_tolerant``).
"""

from isthmus.geo.accounting import TIERS, bytes_delta, format_bytes, total_over_ranks
from isthmus.geo.groups import GeoGroups, build_geo_groups
from isthmus.geo.strategy import GeoSync
from isthmus.geo.sync import build_geo_sync

__all__ = [
    "TIERS",
    "GeoGroups",
    "GeoSync",
    "build_geo_groups",
    "build_geo_sync",
    "bytes_delta",
    "format_bytes",
    "total_over_ranks",
]
