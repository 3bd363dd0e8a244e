"""The CPU peak behind MFU: a best-of probe, a cache keyed by machine and torch, and MFU never above 100%."""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path

import pytest
import torch

import isthmus.profile.device as device
from isthmus.cli import main
from isthmus.log import get_logger
from isthmus.profile.device import (
    PEAK_CACHE_FILE,
    correct_peak,
    cpu_peak_flops,
    cpu_peak_key,
    machine_identity,
    probe_cpu_flops,
)
from isthmus.train.metrics import ThroughputModel

CPU = torch.device("cpu")


@pytest.fixture
def one_thread() -> object:
    """Probes on one thread: on a machine shared with other work, two threads of one probe wait on
    each other whenever one is off its core, and one thread is what a rank of a 2-rank run has."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def counted_probe(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Replace the probe by one that returns 50 GFLOP/s more each call; the list records the calls."""
    calls: list[float] = []

    def probe(dtype: torch.dtype, *args: object, **kwargs: object) -> float:
        calls.append(50e9 * (len(calls) + 1))
        return calls[-1]

    monkeypatch.setattr(device, "probe_cpu_flops", probe)
    monkeypatch.delenv(device.REPROBE_ENV, raising=False)
    return calls


def test_cache_key_names_machine_torch_threads_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    key = cpu_peak_key("fp32", 1)
    assert key == cpu_peak_key("fp32", 1)
    assert f"torch {torch.__version__}" in key and machine_identity() in key
    assert cpu_peak_key("fp32", 1, torch_version="2.99.0") != key
    assert cpu_peak_key("bf16", 1) != key and cpu_peak_key("fp32", 2) != key
    # Another machine: another hostname (a container of the same image), CPU model or core count.
    monkeypatch.setattr(device.socket, "gethostname", lambda: "another-host")
    assert cpu_peak_key("fp32", 1) != key
    monkeypatch.undo()
    monkeypatch.setattr(device, "_cpu_model", lambda: "Some Other CPU")
    assert cpu_peak_key("fp32", 1) != key
    monkeypatch.undo()
    monkeypatch.setattr(device, "usable_cores", lambda: 64)
    assert cpu_peak_key("fp32", 1) != key


def test_stale_cache_is_measured_again(
    tmp_path: Path, counted_probe: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / PEAK_CACHE_FILE
    threads = torch.get_num_threads()
    stale = {
        # What the old code wrote: a bare number with no torch version or machine.
        f"x86_64||2|{threads}|fp32": 1e9,
        # This machine under another torch, and another machine under this torch.
        cpu_peak_key("fp32", threads, torch_version="2.0.0"): {"flops": 2e9, "measured_at": 0},
        cpu_peak_key("fp32", threads, machine="Other CPU | 2 cores | host 000000000000"): {
            "flops": 3e9,
            "measured_at": 0,
        },
    }
    cache.write_text(json.dumps(stale))
    assert cpu_peak_flops("fp32", tmp_path) == 50e9
    assert counted_probe == [50e9]
    known = json.loads(cache.read_text())
    assert known[cpu_peak_key("fp32", threads)]["flops"] == 50e9
    assert f"x86_64||2|{threads}|fp32" not in known  # dropped: nothing says it still holds
    assert len(known) == 3  # the other torch's and the other machine's entries stay theirs
    # Cached now: read, not probed.
    assert cpu_peak_flops("fp32", tmp_path) == 50e9 and len(counted_probe) == 1
    # Forced: by argument (isthmus profile) or by the environment.
    assert cpu_peak_flops("fp32", tmp_path, remeasure=True) == 100e9
    monkeypatch.setenv(device.REPROBE_ENV, "1")
    assert cpu_peak_flops("fp32", tmp_path) == 150e9
    assert json.loads(cache.read_text())[cpu_peak_key("fp32", threads)]["flops"] == 150e9


def test_the_peak_is_described_by_the_probe_that_measured_it(tmp_path: Path, counted_probe: list[float]) -> None:
    threads = torch.get_num_threads()
    cpu_peak_flops("fp32", tmp_path)
    said = device.describe_peak(CPU, "fp32", tmp_path)
    n = device.probe_size(threads)
    assert said.startswith(f"fp32 {n}x{n} matmul, {threads} thread(s), best of 5 x 0.2 s (probe 20"), said


def test_unwritable_cache_still_gives_a_peak(tmp_path: Path, counted_probe: list[float]) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache directory should be
    assert cpu_peak_flops("fp32", blocked) == 50e9
    assert cpu_peak_flops("fp32", blocked) == 100e9  # nothing cached: probed again


@pytest.mark.slow
def test_probe_best_of_is_stable(one_thread: object) -> None:
    first, second = probe_cpu_flops(torch.float32), probe_cpu_flops(torch.float32)
    assert first > 1e9 and second > 1e9  # no CPU of this century does less than a GFLOP/s
    assert 0.8 < first / second < 1.25, (first / 1e9, second / 1e9)


@pytest.fixture
def warnings_logged(caplog: pytest.LogCaptureFixture) -> object:
    """The isthmus logger's warnings, also when an earlier test's setup_logging stopped it propagating."""
    log, propagate = get_logger(), get_logger().propagate
    log.addHandler(caplog.handler)
    log.propagate = False  # each record once, through the handler just added
    caplog.handler.setLevel(logging.WARNING)
    yield caplog
    log.removeHandler(caplog.handler)
    log.propagate = propagate


def test_mfu_stays_at_most_one_with_an_absurdly_low_peak(
    tmp_path: Path, one_thread: object, warnings_logged: pytest.LogCaptureFixture
) -> None:
    """A peak of 1 MFLOP/s cannot be right: the first step above it probes again (one warning),
    a later faster step raises it silently, and no MFU is ever above 1."""
    model = ThroughputModel(
        tokens_per_step=1000,
        flops_per_token=1_000_000,
        peak_flops=1e6,
        devices=2.0,
        correct_peak=partial(correct_peak, CPU, "fp32", cache_dir=tmp_path),
    )
    first = model.mfu(tokens_per_s=2000.0)  # 1 GFLOP/s per device
    probed = model.peak_flops
    assert 0 < first <= 1.0 and probed > 1e9  # probed again: a real CPU's figure
    assert model.mfu(tokens_per_s=2 * probed / 1e6 * 10) == 1.0  # 10x the probe: raised to that rate
    assert model.corrections == 2 and model.peak_flops == pytest.approx(10 * probed)
    warnings = [r for r in warnings_logged.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "above the peak" in warnings[0].getMessage()
    cached = json.loads((tmp_path / PEAK_CACHE_FILE).read_text())[cpu_peak_key("fp32", 1)]
    assert cached["flops"] == model.peak_flops  # the corrected peak replaces the cached one
    # Without a way to correct it (ranks other than 0), MFU is still capped.
    assert ThroughputModel(1000, 1_000_000, peak_flops=1e6).mfu(tokens_per_s=1e6) == 1.0


@pytest.mark.slow
def test_training_with_an_absurdly_low_cached_peak_reports_at_most_100_percent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ISTHMUS_CACHE", str(tmp_path / "peaks"))
    monkeypatch.delenv(device.REPROBE_ENV, raising=False)
    (tmp_path / "peaks").mkdir()
    key = cpu_peak_key("fp32", 1)
    (tmp_path / "peaks" / PEAK_CACHE_FILE).write_text(json.dumps({key: {"flops": 1e6, "measured_at": 0}}))
    jsonl = tmp_path / "m.jsonl"
    assert (
        main(
            [
                "train",
                "--config",
                "tiny",
                "--train.steps",
                "6",
                "--train.threads",
                "1",
                "--data.max_bytes",
                "200000",
                "--metrics.progress",
                "false",
                "--train.run_dir",
                str(tmp_path / "r"),
                "--metrics.jsonl",
                str(jsonl),
                "--data.cache_dir",
                str(tmp_path / "data"),
            ]
        )
        == 0
    )
    mfus = [r["mfu"] for r in map(json.loads, jsonl.read_text().splitlines()) if "mfu" in r]
    assert len(mfus) == 6 and all(0 < m <= 1.0 for m in mfus), mfus
    out = capsys.readouterr().out
    assert "MFU 100.0%" not in out  # the summary uses the corrected peak
    # ... and says what it divided by: the achieved and peak rates, and the probe behind the peak.
    assert "MFU from" in out and "GFLOP/s per device" in out and "matmul" in out, out
    assert json.loads((tmp_path / "peaks" / PEAK_CACHE_FILE).read_text())[key]["flops"] > 1e9
