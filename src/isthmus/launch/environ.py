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


def launcher_world() -> int | None:
    """The world size an external launcher (torchrun, or the emulator's agents) gave this process, or None."""
    return int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None
