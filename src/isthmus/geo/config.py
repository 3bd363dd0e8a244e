"""`GeoConfig`: how data-parallel replicas in several datacenters keep in step (the ``[geo]`` section).

The trainer owns the section in ``isthmus/config.py``; :func:`validate` holds the rules a user can
break, each a :class:`~isthmus.errors.ConfigError` naming the key, the value and the rule.
"""

from __future__ import annotations

from isthmus.config import GeoConfig, SyncKind, WireDtype, validate_geo
from isthmus.errors import ConfigError

# The [geo] section lives with the other sections in isthmus.config (importable without torch).
validate = validate_geo
__all__ = [
    "GeoConfig",
    "SyncKind",
    "WireDtype",
    "ranks_per_datacenter",
    "resolved_outer_dtype",
    "validate",
]


def resolved_outer_dtype(cfg: GeoConfig, kind: str | None = None) -> WireDtype:
    """The outer-gradient wire dtype after resolving ``auto`` (fp32 as DiLoCo, int4 as Streaming DiLoCo)."""
    if cfg.outer_dtype != "auto":
        return cfg.outer_dtype
    return "int4" if (kind or cfg.sync) == "streaming_diloco" else "fp32"


def ranks_per_datacenter(cfg: GeoConfig, world_size: int) -> int:
    """Data-parallel ranks per datacenter; ConfigError when the ranks do not split evenly."""
    if world_size % cfg.datacenters:
        raise ConfigError(
            "geo.datacenters",
            cfg.datacenters,
            f"must divide the {world_size} data-parallel ranks into equal datacenters",
        )
    return world_size // cfg.datacenters
