"""Environment variables set for the duration of a block, then restored (what a launcher hands its children)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` (inherited by processes started meanwhile); restore the old ones after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
