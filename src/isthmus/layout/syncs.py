"""How often a run across datacenters synchronises: DiLoCo's ``geo.inner_steps`` against ``train.steps``.

DiLoCo and Streaming DiLoCo average the datacenters' parameters once every ``geo.inner_steps``
steps (Streaming DiLoCo one fragment at a time, each fragment once per ``inner_steps``). A run of
fewer steps than that never averages them: the datacenters train apart and the run ends as
separate models. The planner caps the interval it picks (:func:`inner_steps_cap`) and
``isthmus train`` warns of a config that syncs too rarely (:func:`sparse_syncs`). Pure Python.
"""

from __future__ import annotations

MIN_SYNCS = 4
"""Syncs a run should make at least: the first sync only starts averaging models that trained apart
for inner_steps steps, so a run needs a few before its datacenters train as one model, and the
last steps after the last sync stay apart; four leaves at most a fifth of the run unsynchronised."""


def inner_steps_cap(steps: int) -> int:
    """The largest ``geo.inner_steps`` that syncs :data:`MIN_SYNCS` times in ``steps`` (at least 1)."""
    return max(1, steps // MIN_SYNCS)


def sparse_syncs(inner_steps: int, steps: int) -> str | None:
    """Why ``geo.inner_steps`` syncs too rarely in ``train.steps`` (one line naming both), or None."""
    if inner_steps <= inner_steps_cap(steps):
        return None
    return (
        f"geo.inner_steps = {inner_steps} syncs the datacenters {steps // inner_steps} time(s) in train.steps = "
        f"{steps}, fewer than {MIN_SYNCS}; geo.inner_steps <= {inner_steps_cap(steps)} syncs {MIN_SYNCS} times"
    )
