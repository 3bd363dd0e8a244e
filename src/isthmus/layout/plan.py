"""``--parallel.plan FILE.json``: run the layout ``isthmus plan --json`` (or ``isthmus simulate --json``) chose.

The file's best layout (the first of ``layouts``; a simulate file is one layout) carries the config
keys to run it with, by section (``parallel``, ``geo``, ``train``, ``model``: see
:meth:`isthmus.layout.spec.LayoutSpec.config_sections`). They replace the config file's values;
a key named on the command line wins over the plan's, and the result is validated as any config.

A plan is data that someone else may have written, so it sets only :data:`PLANNED_KEYS`, what the
planner decides: the layout, its batch, sequence length and precision. Any other key (a folder, a
file, ``train.overwrite``, a seed) is refused, so a plan can never choose where a run's files go
or what it replaces. Pure Python: no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from isthmus.errors import ConfigError
from isthmus.layout.spec import LayoutSpec

SECTIONS = ("parallel", "geo", "train", "model")

PLANNED_KEYS: frozenset[str] = frozenset(
    [*LayoutSpec().config_overrides(), "train.seq_len", "model.tie_embeddings", "train.dtype", "train.compile"]
)
"""The keys a plan file may set: the layout's (:meth:`LayoutSpec.config_sections`, which adds the
sequence length and an untied head) and the precision and compilation the planner priced."""


def is_plan_file(plan: str) -> bool:
    """``parallel.plan`` names a file rather than ``manual`` or ``auto``."""
    return plan not in ("manual", "auto")


def plan_overrides(path: str) -> dict[str, Any]:
    """``section.key -> value`` of the best layout in a plan file; ConfigError naming parallel.plan otherwise."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("parallel.plan", path, "must be manual, auto or a file written by isthmus plan --json")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError("parallel.plan", path, f"not valid JSON ({e})") from None
    return plan_overrides_of(data, path)


def plan_overrides_of(data: object, path: str = "plan.json") -> dict[str, Any]:
    """:func:`plan_overrides` of a plan file's parsed JSON ``data`` (``path`` names it in errors)."""
    layouts = data.get("layouts") if isinstance(data, dict) else None
    best = layouts[0] if isinstance(layouts, list) and layouts else data
    if not isinstance(best, dict) or not isinstance(best.get("parallel"), dict):
        raise ConfigError("parallel.plan", path, "holds no layout (expected the output of isthmus plan --json)")
    out: dict[str, Any] = {}
    for section in SECTIONS:
        values = best.get(section, {})
        if not isinstance(values, dict):
            raise ConfigError("parallel.plan", path, f"its {section!r} entry is not a table of keys")
        for key, value in values.items():
            out[f"{section}.{key}"] = value
    refused = sorted(set(out) - PLANNED_KEYS)
    if refused:
        raise ConfigError(
            "parallel.plan",
            path,
            f"sets {' and '.join(refused)}, which a plan may not set (a plan sets the layout, its batch and "
            "precision, never where files go or what is replaced)",
        )
    return out
