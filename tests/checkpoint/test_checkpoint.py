"""Resumable checkpoints in one process: exact resume, async save, pruning, verification, fallback.

Exactness here is bit-identity, not a tolerance: the same layout in fp32 resumed from a checkpoint
must reproduce every loss, gradient norm and final parameter of the uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from isthmus.checkpoint.manifest import MANIFEST_FILE, find_latest_good, verify_checkpoint
from isthmus.checkpoint.state import load_model_weights
from isthmus.cli import main
from isthmus.config import JobConfig, build_config, parse_overrides
from isthmus.errors import CheckpointError
from isthmus.log import get_logger, setup_logging
from isthmus.train.trainer import Trainer, TrainResult, train

BASE = [
    "--model.flavor",
    "tiny",
    "--train.batch_size",
    "8",
    "--train.seq_len",
    "32",
    "--train.warmup_steps",
    "3",
    "--train.val_every",
    "0",
    "--train.val_batches",
    "1",
    "--data.max_bytes",
    "60000",
    "--metrics.progress",
    "false",
    "--train.threads",
    "1",
]


class _Stop(Exception):
    """Raised by the patched trainer to end a run after a given step, as a crash would."""


def _config(tmp: Path, name: str, *extra: str) -> JobConfig:
    args = [*BASE, "--train.run_dir", str(tmp / name), "--data.cache_dir", str(tmp / "cache"), *extra]
    return build_config(None, parse_overrides(args))


def _train(tmp: Path, name: str, *extra: str) -> TrainResult:
    return train(_config(tmp, name, *extra))


def _final(tmp: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(tmp / name / "final" / "model.pt", weights_only=True)


def _steps(tmp: Path, name: str) -> list[int]:
    records = [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if "loss" in r]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def log_lines() -> Iterator[list[str]]:
    """The messages the isthmus logger emits during the test."""
    logger, handler = get_logger(), _Lines()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def cli_logging() -> Iterator[None]:
    """The CLI points the logger at this test's captured stderr; detach it afterwards."""
    yield
    setup_logging(console=False)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoint")


@pytest.fixture(scope="module")
def straight(tmp: Path) -> TrainResult:
    """20 uninterrupted steps, checkpointed asynchronously at steps 10 and 20."""
    return _train(tmp, "straight", "--train.steps", "20", "--checkpoint.every", "10", "--checkpoint.async_save", "true")


@pytest.mark.slow
def test_exact_resume_after_a_stop(tmp: Path, straight: TrainResult, monkeypatch: pytest.MonkeyPatch) -> None:
    run = ["--train.steps", "20", "--checkpoint.every", "10"]
    original = Trainer.train_step

    def stop_after_10(self: Trainer) -> tuple[float, float]:
        if self.step == 10:
            raise _Stop
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", stop_after_10)
    with pytest.raises(_Stop):
        _train(tmp, "stopped", *run)
    monkeypatch.setattr(Trainer, "train_step", original)
    resumed = _train(tmp, "stopped", *run, "--checkpoint.resume", "auto")

    assert resumed.losses == straight.losses[10:]  # bit-identical, not merely close
    assert resumed.grad_norms == straight.grad_norms[10:]
    ref = _final(tmp, "straight")
    for key, value in _final(tmp, "stopped").items():
        assert torch.equal(value, ref[key]), key
    assert _steps(tmp, "stopped")[-10:] == list(range(11, 21))


@pytest.mark.slow
def test_async_checkpoint_resumes_exactly(tmp: Path, straight: TrainResult) -> None:
    ckpts = tmp / "straight" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000010", "step-000020"]
    assert verify_checkpoint(ckpts / "step-000020").step == 20
    resumed = _train(tmp, "from_async", "--train.steps", "20", "--checkpoint.resume", str(ckpts / "step-000010"))
    assert resumed.losses == straight.losses[10:]


def test_model_weights_of_a_checkpoint_equal_the_final_model(tmp: Path, straight: TrainResult) -> None:
    weights = load_model_weights(tmp / "straight" / "checkpoints" / "step-000020")
    ref = _final(tmp, "straight")
    assert weights.keys() == ref.keys()
    assert all(torch.equal(weights[k], ref[k]) for k in ref)


def test_keep_prunes_and_leftover_partials_are_removed(tmp: Path, log_lines: list[str]) -> None:
    leftover = tmp / "pruned" / "checkpoints" / "step-000007.partial"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"half a save")
    _train(tmp, "pruned", "--train.steps", "4", "--checkpoint.every", "1", "--checkpoint.keep", "2")
    assert sorted(p.name for p in leftover.parent.iterdir()) == ["step-000003", "step-000004"]
    assert any("step-000007.partial" in line and "did not finish" in line for line in log_lines)


def test_crash_mid_save_leaves_the_previous_checkpoint_usable(
    saved: tuple[Path, TrainResult], tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import isthmus.checkpoint.state as checkpoint

    written = checkpoint.write_manifest

    def crash_at_step_4(directory: Path, manifest, key: bytes | None = None) -> None:  # noqa: ANN001
        if manifest.step == 4:
            raise _Stop  # every rank's files are written, the manifest is not: the commit never happens
        written(directory, manifest, key)

    monkeypatch.setattr(checkpoint, "write_manifest", crash_at_step_4)
    run = ["--train.steps", "4", "--checkpoint.every", "2"]
    with pytest.raises(_Stop):
        _train(tmp, "crashed", *run)
    root = tmp / "crashed" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-000002", "step-000004.partial"]
    monkeypatch.setattr(checkpoint, "write_manifest", written)
    resumed = _train(tmp, "crashed", *run, "--checkpoint.resume", "auto")
    assert resumed.losses == saved[1].losses[2:]
    assert sorted(p.name for p in root.iterdir()) == ["step-000002", "step-000004"]


# --- damaged checkpoints ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp: Path) -> tuple[Path, TrainResult]:
    """A 4-step run checkpointed at steps 2 and 4."""
    result = _train(tmp, "saved", "--train.steps", "4", "--checkpoint.every", "2")
    return tmp / "saved" / "checkpoints", result


def _damaged_copy(saved: tuple[Path, TrainResult], tmp_path: Path) -> Path:
    root = tmp_path / "checkpoints"
    shutil.copytree(saved[0], root)
    return root


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_manifest(path: Path) -> None:
    path.write_text(path.read_text().replace('"step": 4', '"step": 40'))


DAMAGE = [
    ("truncated", "__0_0.distcp", _truncate, "bytes, the manifest says"),
    ("flipped", "__0_0.distcp", _flip, "checksum mismatch"),
    ("no_dcp_metadata", ".metadata", Path.unlink, "missing from the checkpoint"),
    ("no_manifest", MANIFEST_FILE, Path.unlink, "incomplete"),
    ("edited_manifest", MANIFEST_FILE, _edit_manifest, "checksum mismatch"),
]


@pytest.mark.parametrize("kind,name,damage,message", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_damage_is_one_line_naming_the_file_and_auto_falls_back(
    saved: tuple[Path, TrainResult],
    tmp_path: Path,
    log_lines: list[str],
    kind: str,
    name: str,
    damage: Callable[[Path], None],
    message: str,
) -> None:
    root = _damaged_copy(saved, tmp_path)
    damage(root / "step-000004" / name)
    with pytest.raises(CheckpointError) as err:
        verify_checkpoint(root / "step-000004")
    line = str(err.value)
    assert "\n" not in line and message in line and str(root / "step-000004" / name) in line, line
    found = find_latest_good(root)
    assert found is not None and found[0] == root / "step-000002"
    assert [line for line in log_lines if "checkpoint skipped" in line] == [f"checkpoint skipped: {err.value}"]


def test_auto_resumes_from_the_newest_good_one(saved: tuple[Path, TrainResult], tmp: Path, tmp_path: Path) -> None:
    root = _damaged_copy(saved, tmp_path)
    _truncate(root / "step-000004" / "__0_0.distcp")
    resumed = _train(
        tmp, "fallback", "--train.steps", "4", "--checkpoint.dir", str(root), "--checkpoint.resume", "auto"
    )
    assert resumed.losses == saved[1].losses[2:]  # from step 2, exactly


def test_auto_with_nothing_good_starts_fresh(
    saved: tuple[Path, TrainResult], tmp: Path, tmp_path: Path, log_lines: list[str]
) -> None:
    root = _damaged_copy(saved, tmp_path)
    for step in ("step-000002", "step-000004"):
        (root / step / ".metadata").unlink()
    result = _train(tmp, "fresh", "--train.steps", "4", "--checkpoint.dir", str(root), "--checkpoint.resume", "auto")
    assert result.losses == saved[1].losses
    assert any("no good checkpoint" in line and "starting fresh" in line for line in log_lines)


def test_resume_path_that_is_damaged_fails_in_one_line(
    saved: tuple[Path, TrainResult], tmp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], cli_logging: None
) -> None:
    root = _damaged_copy(saved, tmp_path)
    _flip(root / "step-000004" / ".metadata")
    args = [
        "train",
        "--config",
        "tiny",
        *BASE,
        "--train.steps",
        "4",
        "--train.run_dir",
        str(tmp_path / "run"),
        "--data.cache_dir",
        str(tmp / "cache"),
        "--checkpoint.resume",
        str(root / "step-000004"),
    ]
    assert main(args) == 2
    line = _error_line(capsys.readouterr().err)
    assert "checksum mismatch" in line and str(root / "step-000004" / ".metadata") in line, line


def test_checkpoint_of_another_model_shape_fails_in_one_line(
    saved: tuple[Path, TrainResult], tmp: Path, capsys: pytest.CaptureFixture[str], cli_logging: None
) -> None:
    _train(tmp, "two_layers", "--train.steps", "2", "--checkpoint.every", "2", "--model.n_layers", "2")
    other = tmp / "two_layers" / "checkpoints" / "step-000002"
    args = [
        "train",
        "--config",
        "tiny",
        *BASE,
        "--train.steps",
        "4",
        "--train.run_dir",
        str(tmp / "shape"),
        "--data.cache_dir",
        str(tmp / "cache"),
        "--checkpoint.resume",
        str(other),
    ]
    assert main(args) == 2
    line = _error_line(capsys.readouterr().err)
    assert "another model shape" in line and "n_layers 2 vs 4" in line, line
    # auto skips it (with a warning) and falls back to the one of the right shape
    root = tmp / "mixed"
    shutil.copytree(saved[0] / "step-000002", root / "step-000002")
    shutil.copytree(other, root / "step-000009")
    found = find_latest_good(root, model=_model_of(saved[0] / "step-000004"))
    assert found is not None and found[0] == root / "step-000002"


def _error_line(stderr: str) -> str:
    """The CLI's error: exactly one line (the rest of stderr is the run's log)."""
    errors = [line for line in stderr.splitlines() if line.startswith("isthmus: error:")]
    assert len(errors) == 1 and stderr.rstrip().endswith(errors[0]), stderr
    return errors[0]


def _model_of(checkpoint: Path) -> dict:
    return verify_checkpoint(checkpoint).model


def test_resume_config_is_validated(tmp_path: Path) -> None:
    from isthmus.errors import ConfigError

    with pytest.raises(ConfigError, match="checkpoint.resume"):
        _config(tmp_path, "x", "--checkpoint.resume", str(tmp_path / "nowhere"))
