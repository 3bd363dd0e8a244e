"""The watch that ranks of a job on several hosts keep on each other through the job's store (a real TCPStore)."""

from __future__ import annotations

import io
import re
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from isthmus.launch import jobwatch
from isthmus.launch.environ import spans_hosts
from isthmus.launch.jobwatch import JobEnd, JobWatch


@pytest.fixture
def port() -> Iterator[int]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    yield server.port
    del server


def client(port: int) -> Any:
    """A rank's own client of the job's store, as `jobwatch._job_store` makes one."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False)
    return dist.PrefixStore("isthmus/watch/run/0/", store)


def test_spans_hosts_reads_torchruns_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert spans_hosts()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # every rank on this host
    assert not spans_hosts()


def test_a_silent_rank_is_named_with_its_host_and_the_others_end_in_its_line(
    port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 on host1 stops beating (its process stopped): the watcher on host0 names it, every rank
    learns the reason, and a rank still stuck after the grace prints the line and exits with 3."""
    monkeypatch.setattr(jobwatch, "STUCK_GRACE_S", 0.3)
    exits: list[int] = []
    console = io.StringIO()
    w0 = JobWatch(
        0, 2, lambda: 7, 0.5, watcher=True, store=client(port), host="host0", exit_fn=exits.append, console=console
    )
    w1 = JobWatch(1, 2, lambda: 7, 0.5, watcher=False, store=client(port), host="host1", exit_fn=exits.append)
    w0.start()
    w1.start()
    time.sleep(0.3)
    assert w0.end is None  # both beat: nothing to say
    w1.stop(done=False)  # silent from here on, not finished
    deadline = time.monotonic() + 5
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    w0.stop()
    assert exits == [3]
    assert w0.end is not None and (w0.end.kind, w0.end.rank, w0.end.host) == ("stall", 1, "host1")
    assert re.fullmatch(
        r"isthmus: error: rank 1 on host1 stopped answering for \d+ s \(last step it finished: 7\); "
        r"stopped every rank \(parallel.timeout_s = 0.5\)\n",
        console.getvalue(),
    )


def test_a_finished_rank_is_not_a_stalled_one(port: int) -> None:
    w0 = JobWatch(0, 2, lambda: 3, 0.3, watcher=True, store=client(port), host="host0", exit_fn=lambda c: None)
    w1 = JobWatch(1, 2, lambda: 3, 0.3, watcher=False, store=client(port), host="host1", exit_fn=lambda c: None)
    w0.start()
    w1.start()
    w1.stop(done=True)
    time.sleep(1.0)  # three timeouts
    w0.stop()
    assert w0.end is None


def test_the_first_reason_posted_stands_for_every_rank(port: int) -> None:
    """A SIGTERM on host1 posted first; the lost connection that rank 0 sees after it is not the reason."""
    w0 = JobWatch(0, 2, lambda: 1, 10, watcher=True, store=client(port), host="host0")
    w1 = JobWatch(1, 2, lambda: 1, 10, watcher=False, store=client(port), host="host1")
    first = JobEnd("signal", 1, "host1", 143, "SIGTERM to rank 1 on host1")
    assert w1.post(first) == first
    assert w0.wait_for_end(1.0) == first
    assert w0.post(JobEnd("lost", 0, "host0", 3, "rank 0 on host0 lost the job's other ranks")) == first
