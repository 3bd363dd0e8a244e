"""MFU's peak on a job over several hosts: each host's cores and peak, not rank 0's machine times the world."""

from __future__ import annotations

import pytest
import torch

from isthmus.profile.device import RankPeak, describe_hosts, devices_worth, host_peaks, job_devices

CPU = torch.device("cpu")


def test_alike_hosts_count_as_one_machine_times_the_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two hosts of 4 cores, 2 ranks of 4 threads each: each host's ranks share its cores, as on one machine."""
    monkeypatch.setattr("isthmus.profile.device.usable_cores", lambda: 4)
    ranks = [RankPeak(f"host{r // 2}", 8e9, threads=4, cores=4) for r in range(4)]
    assert host_peaks(ranks) == {"host0": 8e9, "host1": 8e9}  # 2 ranks x half of the cores x 8 GFLOP/s
    assert job_devices(ranks, 8e9) == pytest.approx(devices_worth(4, 2, 4, CPU)) == pytest.approx(2.0)


def test_unlike_hosts_each_count_their_own_cores_and_peak() -> None:
    """host0: 2 ranks on 1 core at 10 GFLOP/s; host1: 1 rank of 4 threads on 4 cores at 40 GFLOP/s.
    Rank 0's machine times the world would say 3 x 1/2 x 10 = 15 GFLOP/s; the job has 10 + 40."""
    ranks = [
        RankPeak("host0", 10e9, threads=1, cores=1),
        RankPeak("host0", 10e9, threads=1, cores=1),
        RankPeak("host1", 40e9, threads=4, cores=4),
    ]
    assert host_peaks(ranks) == {"host0": 10e9, "host1": 40e9}
    assert job_devices(ranks, reference_peak=10e9) == pytest.approx(5.0)  # MFU divides by 5 x rank 0's peak
    assert describe_hosts(ranks) == (
        "host0 2 rank(s) on 1 core(s), 10.0 GFLOP/s; host1 1 rank(s) on 4 core(s), 40.0 GFLOP/s"
    )


def test_ranks_asking_fewer_threads_than_cores_leave_the_rest_uncounted() -> None:
    """A rank of 2 threads on an 8-core host has its 2 threads' peak, not the host's 8 cores."""
    ranks = [RankPeak("a", 5e9, threads=2, cores=8), RankPeak("b", 5e9, threads=2, cores=8)]
    assert job_devices(ranks, 5e9) == pytest.approx(2.0)
    # More threads than cores are the cores': the probe ran on at most that many.
    crowded = [RankPeak("a", 4e9, threads=16, cores=2), RankPeak("a", 4e9, threads=16, cores=2)]
    assert host_peaks(crowded) == {"a": pytest.approx(4e9)}
