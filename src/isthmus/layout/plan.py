"""``--parallel.plan FILE.json``: run the layout ``isthmus plan --json`` (or ``isthmus simulate --json``) chose.

The file's best layout (the first of ``layouts``; a simulate file is one layout) carries the config
keys to run it with, by section (``parallel``, ``geo``, ``train``, ``model``: see
:meth:`isthmus.layout.spec.LayoutSpec.config_sections`). They replace the config file's values;
a key named on the command line wins over the plan's, and the result is validated as any config.
Pure Python: no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from isthmus.errors import ConfigError

SECTIONS = ("parallel", "geo", "train", "model")


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
    return out
