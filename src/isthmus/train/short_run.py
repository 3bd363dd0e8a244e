"""The short-run override: ``ISTHMUS_MAX_STEPS=N`` caps every run (and every benchmark loop) at N.

The README's and docs' commands are run as written by the tests with this set, so they finish in
seconds; a user can set it too, for a smoke run. A run trains at most N more optimizer steps (its
learning-rate schedule still follows ``train.steps``, and the last step taken is saved as the last
one, so a run resumed the same way continues from it); a benchmark runs each of its loops (rounds,
timed steps, repeats, layouts) at most N times and ``isthmus profile`` measures for at most N
seconds, so their figures then mean nothing.
"""

from __future__ import annotations

import os

from isthmus.errors import ConfigError

MAX_STEPS_ENV = "ISTHMUS_MAX_STEPS"


def max_steps_override() -> int | None:
    """N from ``ISTHMUS_MAX_STEPS``, or None when it is unset or empty; anything but a positive integer is one line."""
    value = os.environ.get(MAX_STEPS_ENV, "")
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(MAX_STEPS_ENV, value, "must be a positive integer (steps per run)")
    return int(value)


def capped(count: int) -> int:
    """``count``, or at most N under the override (a benchmark's rounds, steps or repeats)."""
    cap = max_steps_override()
    return count if cap is None else min(count, cap)
