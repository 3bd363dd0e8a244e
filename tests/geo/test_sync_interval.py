"""A run across datacenters syncs at least MIN_SYNCS times: the planner caps DiLoCo's inner_steps by
train.steps, and `isthmus train` warns, in one line naming both keys, of a config that syncs less."""

from __future__ import annotations

import pytest

from isthmus.cli.train import train_config
from isthmus.layout.syncs import MIN_SYNCS, inner_steps_cap, sparse_syncs
from isthmus.planner.search import SearchSpace


def test_the_cap_syncs_min_syncs_times() -> None:
    assert inner_steps_cap(20) == 20 // MIN_SYNCS and inner_steps_cap(1) == 1
    assert sparse_syncs(inner_steps_cap(20), 20) is None and sparse_syncs(100, 1000) is None
    assert sparse_syncs(100, 20) is not None and "geo.inner_steps = 100" in sparse_syncs(100, 20)  # type: ignore[operator]
    # The search's settings follow the run's length; Streaming DiLoCo's fragments and overlap fit in it.
    space = SearchSpace(steps=8)
    assert [space.setting(k) for k in ("inner_steps", "fragments", "overlap_steps")] == [2, 2, 1]
    assert [SearchSpace(steps=3).setting(k) for k in ("inner_steps", "fragments", "overlap_steps")] == [1, 1, 0]
    assert (
        SearchSpace().setting("inner_steps") == 100
        and SearchSpace({"inner_steps": 50}, steps=8).setting("inner_steps") == 50
    )


@pytest.mark.parametrize(("steps", "warned"), [(20, True), (400, False)])
def test_train_warns_of_a_run_that_syncs_too_rarely(
    steps: int, warned: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    geo = ["--geo.datacenters", "2", "--geo.sync", "diloco", "--geo.inner_steps", "100"]
    train_config(None, [*geo, "--train.steps", str(steps)], announce=False)
    err = capsys.readouterr().err
    assert (err.count("\n"), "geo.inner_steps = 100" in err and "train.steps = 20" in err) == (
        (1, True) if warned else (0, False)
    )
