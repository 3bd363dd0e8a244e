"""The watch that ranks of a job on several hosts keep on each other through the job's store (a real TCPStore),
and how their lines are said once per host."""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from isthmus.errors import ConfigError, IsthmusError, RunFailed
from isthmus.launch import environ, jobwatch
from isthmus.launch.environ import said_once_per_host, spans_hosts
from isthmus.launch.jobwatch import JobEnd, JobWatch
from isthmus.launch.local import _transport_words


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


@pytest.mark.parametrize("handled", [False, True], ids=["main_thread_blocked", "handler_ran"])
def test_a_stop_signal_the_main_thread_cannot_take_is_posted_by_the_watch(
    port: int, monkeypatch: pytest.MonkeyPatch, handled: bool
) -> None:
    """SIGTERM reaches a rank whose main thread waits in a collective on a frozen peer (its Python handler
    cannot run: ``handled`` stays false): its thread reads the signal off the wake-up fd, posts it as
    the job's end, and ends the rank with 143 and the line. A handler that ran leaves it to the rank."""
    monkeypatch.setattr(jobwatch, "STUCK_GRACE_S", 0.3)
    monkeypatch.setattr(jobwatch, "SIGNAL_GRACE_S", 0.2)
    exits: list[int] = []
    console = io.StringIO()
    w0 = JobWatch(
        0, 2, lambda: 4, 10, watcher=True, store=client(port), host="host0", exit_fn=exits.append, console=console
    )
    before = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # as `stop_on_signals` installs one
    try:
        w0.start()
        w0.take_signals(lambda: handled)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + (5 if not handled else 1.5)
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
        w0.stop(done=False)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert signal.set_wakeup_fd(-1) == -1  # the wake-up fd before it is back
    if handled:
        assert exits == [] and w0.end is None
        return
    assert exits == [143]
    assert w0.end == JobEnd("signal", 0, "host0", 143, "SIGTERM to rank 0 on host0")
    assert console.getvalue() == "isthmus: SIGTERM to rank 0 on host0\n"


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


def test_an_error_every_rank_meets_is_said_once_per_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each host's local rank 0 says it, naming itself; the others exit quietly with its code."""
    monkeypatch.setattr(environ, "QUIET_EXIT_DELAY_S", 0.0)
    for key, value in {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    said = said_once_per_host(ConfigError("train.seq_len", -5, "must be at least 1"), named=False)
    assert isinstance(said, IsthmusError) and said.exit_code == 2
    assert str(said) == f"train.seq_len = -5: must be at least 1 (rank 2 on {socket.gethostname()})"
    monkeypatch.setenv("LOCAL_RANK", "1")
    quiet = said_once_per_host(RunFailed("x"))
    assert isinstance(quiet, SystemExit) and quiet.code == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # one host: the error as it is
    error = ConfigError("train.seq_len", -5, "must be at least 1")
    assert said_once_per_host(error, named=False) is error


def test_a_lost_connection_keeps_what_gloo_says_went_away() -> None:
    gloo = (
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[10.213.0.101]:56488. This is typically caused by a remote worker crashing. Check the logs"
    )
    assert _transport_words(RuntimeError(gloo)) == "Connection closed by peer [10.213.0.101]:56488"
    assert _transport_words(RuntimeError("")) == "RuntimeError"
