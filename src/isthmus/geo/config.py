"""`GeoConfig`: how data-parallel replicas in several datacenters keep in step (the ``[geo]`` section).

The trainer owns the section in ``isthmus/config.py``; :func:`validate` holds the rules a user can
break, each a :class:`~isthmus.errors.ConfigError` naming the key, the value and the rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from isthmus.errors import ConfigError

SyncKind = Literal["none", "flat", "hierarchical", "compressed", "diloco", "streaming_diloco"]
WireDtype = Literal["fp32", "bf16", "int8", "int4"]


@dataclass
class GeoConfig:
    sync: SyncKind = "none"
    """Cross-datacenter sync: none, flat, hierarchical, compressed, diloco or streaming_diloco."""
    datacenters: int = 1
    """Datacenters the data-parallel ranks are split into, equally: rank = dc * ranks_per_dc + local."""
    wan_dtype: Literal["int8", "int4"] = "int8"
    """compressed: dtype of gradient shards on the WAN hop (per-block absmax scales, fp32)."""
    block_size: int = 256
    """Elements per quantisation block (one fp32 scale each); even, so int4 packs two per byte."""
    error_feedback: bool = True
    """Add each rank's quantisation error to the next value it quantises (compressed and quantised outer gradients)."""
    bucket_mb: int = 25
    """Largest flat fp32 buffer per collective, in MiB (one parameter larger than this gets its own)."""
    inner_steps: int = 50
    """diloco / streaming_diloco: inner optimizer steps H between two syncs of the same parameters."""
    outer_lr: float = 0.7
    """diloco / streaming_diloco: outer Nesterov SGD learning rate (DiLoCo paper: 0.7)."""
    outer_momentum: float = 0.9
    """diloco / streaming_diloco: outer Nesterov momentum (DiLoCo paper: 0.9; 0 = plain SGD)."""
    fragments: int = 4
    """streaming_diloco: parameter fragments synchronised in turn, staggered by inner_steps // fragments."""
    overlap_steps: int = 1
    """streaming_diloco: inner steps tau between launching a fragment's transfer and applying its result."""
    mix_alpha: float = 0.5
    """streaming_diloco: fragment <- alpha * local + (1 - alpha) * global when applied (0 = replace by global)."""
    outer_dtype: Literal["auto", "fp32", "bf16", "int8", "int4"] = "auto"
    """diloco / streaming_diloco: outer-gradient dtype on the WAN; auto = fp32 for diloco, int4 for streaming."""


def resolved_outer_dtype(cfg: GeoConfig, kind: str | None = None) -> WireDtype:
    """The outer-gradient wire dtype after resolving ``auto`` (fp32 as DiLoCo, int4 as Streaming DiLoCo)."""
    if cfg.outer_dtype != "auto":
        return cfg.outer_dtype
    return "int4" if (kind or cfg.sync) == "streaming_diloco" else "fp32"


def validate(cfg: GeoConfig) -> None:
    """Raise ConfigError for the first setting that breaks a rule; returns None when all hold."""
    if cfg.datacenters < 1:
        raise ConfigError("geo.datacenters", cfg.datacenters, "must be at least 1")
    if cfg.block_size < 2 or cfg.block_size % 2:
        raise ConfigError("geo.block_size", cfg.block_size, "must be an even integer of at least 2")
    if cfg.bucket_mb < 1:
        raise ConfigError("geo.bucket_mb", cfg.bucket_mb, "must be at least 1")
    if cfg.inner_steps < 1:
        raise ConfigError("geo.inner_steps", cfg.inner_steps, "must be at least 1")
    if cfg.outer_lr <= 0:
        raise ConfigError("geo.outer_lr", cfg.outer_lr, "must be positive")
    if not 0 <= cfg.outer_momentum < 1:
        raise ConfigError("geo.outer_momentum", cfg.outer_momentum, "must be in [0, 1)")
    if not 0 <= cfg.mix_alpha < 1:
        raise ConfigError("geo.mix_alpha", cfg.mix_alpha, "must be in [0, 1) (1 would never take the global value)")
    if cfg.sync == "streaming_diloco":
        if not 1 <= cfg.fragments <= cfg.inner_steps:
            raise ConfigError(
                "geo.fragments", cfg.fragments, f"must be between 1 and geo.inner_steps = {cfg.inner_steps}"
            )
        if not 0 <= cfg.overlap_steps < cfg.inner_steps:
            raise ConfigError(
                "geo.overlap_steps", cfg.overlap_steps,
                f"must be in [0, geo.inner_steps = {cfg.inner_steps}): a result must land before the next sync",
            )


def ranks_per_datacenter(cfg: GeoConfig, world_size: int) -> int:
    """Data-parallel ranks per datacenter; ConfigError when the ranks do not split evenly."""
    if world_size % cfg.datacenters:
        raise ConfigError(
            "geo.datacenters", cfg.datacenters,
            f"must divide the {world_size} data-parallel ranks into equal datacenters",
        )
    return world_size // cfg.datacenters
