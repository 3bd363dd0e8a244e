"""isthmus: train transformer language models in parallel, from one CPU to several datacenters.

``import isthmus`` stays light: torch and the heavy parts load on first use of an attribute.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "JobConfig": "isthmus.config",
    "build_config": "isthmus.config",
    "ModelArgs": "isthmus.models.args",
    "build_model": "isthmus.models.llama",
    "init_weights": "isthmus.models.llama",
    "train": "isthmus.train.trainer",
    "IsthmusError": "isthmus.errors",
    "parallelize": "isthmus.api",
    "ParallelDims": "isthmus.layout.dims",
    "LayoutSpec": "isthmus.layout.spec",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'isthmus' has no attribute {name!r}")


__all__ = sorted(_LAZY) + ["__version__"]
