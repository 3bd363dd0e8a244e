"""The hosts of a multi-node run's starts, and the line an elastic restart prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from isthmus.train.membership import host_change, multi_node, read_hosts, resume_line, write_hosts


def test_a_host_that_left_is_named_with_the_ranks_it_held() -> None:
    change = host_change(["host0", "host0", "host1", "host1"], ["host0", "host0"])
    assert change and str(change) == "host1 left (ranks 2, 3)"
    assert resume_line(change, 40, 46, 2, 2) == (
        "isthmus: host1 left (ranks 2, 3); resuming from step 40 (6 steps lost) at world 2, dp 2"
    )


def test_a_host_that_joined_and_one_that_left_are_both_named() -> None:
    change = host_change(["host0", "host1"], ["host0", "host2"])
    assert str(change) == "host1 left (rank 1), host2 joined (rank 1)"
    assert resume_line(change, 8, 9, 2, 2).endswith("resuming from step 8 (1 step lost) at world 2, dp 2")
    assert resume_line(change, None, 3, 2, 2).endswith(
        "no checkpoint to resume from: starting over (3 steps lost) at world 2, dp 2"
    )


def test_the_same_hosts_are_no_change() -> None:
    assert not host_change(["host0", "host1"], ["host0", "host1"])
    # The ranks may be dealt to the hosts in another order: still the same hosts.
    assert not host_change(["host0", "host1"], ["host1", "host0"])


def test_the_record_round_trips_and_a_damaged_one_is_none(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "hosts.json"
    assert read_hosts(path) is None
    write_hosts(path, ["host0", "host1"])
    assert read_hosts(path) == ["host0", "host1"]
    path.write_text('{"hosts": [1, 2]}')
    assert read_hosts(path) is None
    path.write_text("{")
    assert read_hosts(path) is None


def test_multi_node_reads_torchruns_node_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GROUP_WORLD_SIZE", raising=False)
    assert not multi_node()
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert multi_node()
