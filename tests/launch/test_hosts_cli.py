"""`isthmus emulate --hosts N`: what it refuses before any host exists, how a job's end becomes its
last line and exit code, and the watch that stops every host when one fails. The runs themselves
are in test_hosts.py (root)."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from isthmus.cli.emulate_hosts import exit_code
from isthmus.cli.main import main
from isthmus.errors import Interrupted, RunFailed
from isthmus.launch.hosts import JobEnd, _watch


def test_datacenter_flags_and_bad_counts_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for args, key in (
        (["--hosts", "2", "--wan-mbit", "5"], "--wan-mbit"),
        (["--hosts", "2", "--topology", "emulated-2dc"], "--topology"),
        (["--hosts", "0"], "--hosts"),
        (["--hosts", "2", "--nproc-per-node", "0"], "--nproc-per-node"),
        (["--nproc-per-node", "2"], "--nproc-per-node"),
    ):
        assert main(["emulate", *args, "--", "train"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and key in err, err


def test_the_train_command_is_checked_as_rank_0_of_the_job_sees_it(capsys: pytest.CaptureFixture[str]) -> None:
    # 2 hosts x 2 ranks: parallel.nproc, if named, must be the job's 4.
    assert main(["emulate", "--hosts", "2", "--nproc-per-node", "2", "--", "train", "--parallel.nproc", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "parallel.nproc" in err and "4" in err, err
    assert main(["emulate", "--hosts", "2", "--", "train", "--config", "tiny", "--print-config"]) == 0
    assert "[parallel]" in capsys.readouterr().out


def test_without_root_one_line_says_so(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["emulate", "--hosts", "2", "--", "train", "--config", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [
        "isthmus: error: emulated hosts need root (ip netns, veth, unshare --uts): run it as root"
    ], err


def test_a_job_end_is_the_last_line_and_its_exit_code() -> None:
    assert exit_code(JobEnd(0), None) == 0
    with pytest.raises(RunFailed, match="host1's torchrun ended first \\(exit code 2\\)") as failed:
        exit_code(JobEnd(2, 1, "exit code 2"), None)
    assert failed.value.exit_code == 2  # the failed rank's own code, as its agent passed it on
    with pytest.raises(Interrupted, match="SIGINT") as stopped:
        exit_code(JobEnd(130), None)
    assert stopped.value.exit_code == 130
    with pytest.raises(RunFailed, match="--timeout of 5 s"):
        exit_code(JobEnd(124), 5.0)


@pytest.mark.slow
def test_the_first_host_that_fails_stops_the_others() -> None:
    procs = [
        subprocess.Popen(["sleep", "30"], start_new_session=True, text=True),
        subprocess.Popen(["sh", "-c", "sleep 0.2; exit 3"], start_new_session=True, text=True),
    ]
    end = _watch(procs, timeout_s=20, grace_s=2.0)
    assert end == JobEnd(3, 1, "exit code 3")
    assert procs[0].returncode == -signal.SIGTERM
    killed = subprocess.Popen(["sleep", "30"], start_new_session=True, text=True)
    killed.send_signal(signal.SIGKILL)
    assert _watch([killed], timeout_s=20, grace_s=2.0) == JobEnd(3, 0, "killed by SIGKILL")
