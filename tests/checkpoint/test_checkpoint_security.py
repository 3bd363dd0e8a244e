"""Checkpoints and exported files cannot run code, and with a key they cannot be altered unnoticed.

The attack: a checkpoint directory whose DCP ``.metadata`` pickle calls ``os.system`` (here it
writes a marker file), with the manifest's sha256s recomputed so that every checksum passes, as
anyone who can write the directory can do. Loading it through ``isthmus train --checkpoint.resume``
(auto or a path) or ``isthmus export --checkpoint`` must refuse it before the pickle runs: no
marker file, exit code 2, one line naming the file and the refused global. The checksums catch
accidents only; a key (``checkpoint.key_file`` / ``$ISTHMUS_CHECKPOINT_KEY_FILE``) signs the
manifest, so an edited file is refused even with its sha256 recomputed.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from isthmus.checkpoint.manifest import (
    KEY_ENV,
    MANIFEST_FILE,
    checkpoint_key,
    find_latest_good,
    verify_checkpoint,
)
from isthmus.checkpoint.reader import read_metadata
from isthmus.cli import main
from isthmus.errors import CheckpointError, ConfigError, UnsafeCheckpoint
from isthmus.log import setup_logging
from isthmus.weights.export import load_exported

BASE = [
    "--config",
    "tiny",
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
    "--train.steps",
    "4",
    "--checkpoint.every",
    "2",
]


class _RunsCode:
    """Pickles as a call of os.system: what a crafted checkpoint would smuggle in."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Iterator[pytest.CaptureFixture[str]]:
    """main() in this process; the logger it points at the captured stderr is detached afterwards."""
    yield capsys
    setup_logging(console=False)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("security")


def _train_args(tmp: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["train", *BASE, "--train.run_dir", str(run_dir), "--data.cache_dir", str(tmp / "cache"), *extra]


def _error_line(stderr: str) -> str:
    """The CLI's error: exactly one line, the last one, no traceback."""
    errors = [line for line in stderr.splitlines() if line.startswith("isthmus: error:")]
    assert len(errors) == 1 and stderr.rstrip().endswith(errors[0]) and "Traceback" not in stderr, stderr
    return errors[0]


@pytest.fixture(scope="module")
def run(tmp: Path) -> Path:
    """A finished 4-step run checkpointed at steps 2 and 4, unsigned."""
    run_dir = tmp / "run"
    assert main(_train_args(tmp, run_dir)) == 0
    setup_logging(console=False)
    return run_dir


@pytest.fixture(scope="module")
def key_file(tmp: Path) -> Path:
    path = tmp / "checkpoint.key"
    path.write_text("a secret of more than sixteen bytes\n")
    return path


@pytest.fixture(scope="module")
def signed(tmp: Path, key_file: Path) -> Path:
    """The same run, its checkpoints signed with ``key_file``."""
    run_dir = tmp / "signed"
    assert main(_train_args(tmp, run_dir, "--checkpoint.key_file", str(key_file))) == 0
    setup_logging(console=False)
    return run_dir


# --- what an attacker does: edit a file, then make the plain checksums agree -----------------------
def _recompute_manifest(directory: Path) -> None:
    """Recompute every file's sha256 and the manifest's own, as anyone can; an HMAC stays as it was."""
    path = directory / MANIFEST_FILE
    body = json.loads(path.read_text())
    for name, entry in body["files"].items():
        data = (directory / name).read_bytes()
        entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    body.pop("manifest_sha256")
    signature = body.pop("manifest_hmac_sha256", None)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    body["manifest_sha256"] = hashlib.sha256(canonical).hexdigest()
    if signature is not None:
        body["manifest_hmac_sha256"] = signature
    path.write_text(json.dumps(body, indent=1))


def _poison(directory: Path, marker: Path) -> Path:
    """Replace the checkpoint's DCP metadata by the real one carrying a call of os.system; returns its path."""
    metadata = FileSystemReader(str(directory)).read_metadata()  # torch's own reader: the file is still genuine
    metadata.planner_data = _RunsCode(marker)  # a field DCP pickles as it is
    path = directory / ".metadata"
    path.write_bytes(pickle.dumps(metadata))
    _recompute_manifest(directory)
    verify_checkpoint(directory)  # every checksum passes: nothing but the content gives it away
    return path


@pytest.fixture
def marker(tmp_path: Path) -> Iterator[Path]:
    """Where the crafted pickle writes; the payload is checked to really run under plain pickle."""
    path = tmp_path / "ran-code"
    pickle.loads(pickle.dumps(_RunsCode(path)))
    assert path.exists(), "the payload does not run code; the tests below would prove nothing"
    path.unlink()
    yield path
    assert not path.exists(), "the crafted checkpoint ran code"


def _poisoned_run(run: Path, tmp_path: Path, marker: Path) -> tuple[Path, Path]:
    """A copy of ``run`` whose newest checkpoint is crafted; (run copy, crafted .metadata)."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy, _poison(copy / "checkpoints" / "step-000004", marker)


# --- crafted metadata never runs ---------------------------------------------------------------------
@pytest.mark.parametrize("resume", ["auto", "path"])
def test_crafted_metadata_is_refused_on_resume(
    run: Path, tmp: Path, tmp_path: Path, marker: Path, cli: pytest.CaptureFixture[str], resume: str
) -> None:
    copy, metadata = _poisoned_run(run, tmp_path, marker)
    target = "auto" if resume == "auto" else str(metadata.parent)
    args = _train_args(tmp, copy, "--train.steps", "6", "--checkpoint.resume", target)
    assert main(args) == 2
    line = _error_line(cli.readouterr().err)
    assert f"{metadata}: refuses to load posix.system (a checkpoint holds data only)" in line, line
    assert not marker.exists()


@pytest.mark.parametrize("which", ["latest", "dir"])
def test_crafted_metadata_is_refused_by_export(
    run: Path, tmp_path: Path, marker: Path, cli: pytest.CaptureFixture[str], which: str
) -> None:
    copy, metadata = _poisoned_run(run, tmp_path, marker)
    out = tmp_path / "model.safetensors"
    checkpoint = ["--checkpoint"] if which == "latest" else ["--checkpoint", str(metadata.parent)]
    assert main(["export", "--run", str(copy), "--out", str(out), *checkpoint]) == 2
    line = _error_line(cli.readouterr().err)
    assert f"{metadata}: refuses to load posix.system" in line, line
    assert not marker.exists() and not out.exists()


def _rewrite_metadata(directory: Path, change: Any) -> None:
    metadata = read_metadata(directory)
    change(metadata)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


def test_metadata_of_bytes_entries_or_outside_files_is_refused(run: Path, tmp_path: Path) -> None:
    """DCP reads a "bytes" entry with torch.load(weights_only=False), and a data file by the path the
    metadata names: isthmus saves neither, so neither loads."""
    bytes_entry = tmp_path / "bytes"
    shutil.copytree(run / "checkpoints" / "step-000004", bytes_entry)
    _rewrite_metadata(
        bytes_entry, lambda m: m.state_dict_metadata.__setitem__("model.norm.weight", BytesStorageMetadata())
    )
    with pytest.raises(
        UnsafeCheckpoint, match="refuses to load torch.distributed.checkpoint.metadata.BytesStorageMetadata"
    ):
        read_metadata(bytes_entry)

    outside = tmp_path / "outside"
    shutil.copytree(run / "checkpoints" / "step-000004", outside)

    def point_outside(m: Any) -> None:
        for info in m.storage_data.values():
            info.relative_path = "../../elsewhere.distcp"

    _rewrite_metadata(outside, point_outside)
    with pytest.raises(
        UnsafeCheckpoint, match=r"names data file '\.\./\.\./elsewhere\.distcp', outside the checkpoint"
    ):
        read_metadata(outside)


# --- signed checkpoints --------------------------------------------------------------------------------
def _losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def test_signed_checkpoint_resumes_with_the_key(
    signed: Path,
    key_file: Path,
    tmp: Path,
    tmp_path: Path,
    cli: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    step2 = signed / "checkpoints" / "step-000002"
    assert "manifest_hmac_sha256" in json.loads((step2 / MANIFEST_FILE).read_text())
    monkeypatch.setenv(KEY_ENV, str(key_file))  # the environment's key, this time
    resumed = tmp_path / "resumed"
    assert main(_train_args(tmp, resumed, "--checkpoint.resume", str(step2))) == 0
    assert _losses(resumed) == _losses(signed)[2:]  # steps 3 and 4, exactly as the signed run took them


def _tamper(directory: Path) -> None:
    """Change one byte of the tensor data, then recompute the plain checksums (the HMAC cannot be)."""
    distcp = directory / "__0_0.distcp"
    data = bytearray(distcp.read_bytes())
    data[len(data) // 2] ^= 0x01
    distcp.write_bytes(bytes(data))
    _recompute_manifest(directory)


def test_tampered_signed_checkpoint_is_refused_with_the_key(
    signed: Path, key_file: Path, tmp: Path, tmp_path: Path, cli: pytest.CaptureFixture[str]
) -> None:
    tampered = tmp_path / "step-000004"
    shutil.copytree(signed / "checkpoints" / "step-000004", tampered)
    _tamper(tampered)
    assert verify_checkpoint(tampered).step == 4  # without the key: the plain sha256s all agree
    args = _train_args(
        tmp,
        tmp_path / "run",
        "--train.steps",
        "6",
        "--checkpoint.resume",
        str(tampered),
        "--checkpoint.key_file",
        str(key_file),
    )
    assert main(args) == 2
    line = _error_line(cli.readouterr().err)
    assert f"{tampered / MANIFEST_FILE}: signature mismatch" in line, line


def test_unsigned_checkpoint_is_refused_with_a_key_and_auto_skips_it(
    run: Path, signed: Path, key_file: Path, tmp_path: Path
) -> None:
    key = checkpoint_key(str(key_file))
    with pytest.raises(CheckpointError, match="not signed, and a checkpoint key is set") as err:
        verify_checkpoint(run / "checkpoints" / "step-000004", key=key)
    assert "\n" not in str(err.value)
    root = tmp_path / "mixed"
    shutil.copytree(signed / "checkpoints" / "step-000002", root / "step-000002")
    shutil.copytree(run / "checkpoints" / "step-000004", root / "step-000004")
    found = find_latest_good(root, key=key)
    assert found is not None and found[0] == root / "step-000002"


def test_a_short_or_missing_key_stops_before_any_work(
    tmp: Path, tmp_path: Path, cli: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    short = tmp_path / "short.key"
    short.write_text("tooshort\n")
    with pytest.raises(ConfigError, match="checkpoint.key_file = .*holds 8 bytes; a key needs at least 16"):
        checkpoint_key(str(short))
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "nowhere.key"))
    assert main(_train_args(tmp, tmp_path / "run")) == 2
    assert f"{KEY_ENV} = '{tmp_path / 'nowhere.key'}': cannot be read" in _error_line(cli.readouterr().err)
    assert not (tmp_path / "run").exists()


# --- exported files --------------------------------------------------------------------------------
def test_export_of_a_signed_checkpoint_is_signed(
    signed: Path, key_file: Path, tmp_path: Path, cli: pytest.CaptureFixture[str]
) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    out = tmp_path / "model.safetensors"
    assert main(["export", "--run", str(signed), "--out", str(out), "--checkpoint", "--key-file", str(key_file)]) == 0
    key = checkpoint_key(str(key_file))
    assert load_exported(out, key).metadata["isthmus.hmac_sha256"]
    # Another config in the metadata, the tensors untouched: the plain sha256 still agrees, the HMAC does not.
    with safe_open(str(out), framework="pt") as f:
        metadata = dict(f.metadata())
    metadata["isthmus.config"] = metadata["isthmus.config"].replace('"tiny"', '"small"')
    altered = tmp_path / "altered.safetensors"
    save_file(load_file(str(out)), str(altered), metadata=metadata)
    load_exported(altered)  # without the key it reads
    cli.readouterr()
    assert main(["generate", "--model", str(altered), "--max-new-tokens", "2", "--key-file", str(key_file)]) == 2
    assert f"{altered}: signature mismatch" in _error_line(cli.readouterr().err)


def test_signed_final_model_is_checked_by_export_and_generate(
    signed: Path, key_file: Path, tmp_path: Path, cli: pytest.CaptureFixture[str]
) -> None:
    """Else exporting with a key would sign whatever final/model.pt someone put there."""
    copy = tmp_path / "run"
    shutil.copytree(signed, copy)
    out = tmp_path / "final.safetensors"
    key_args = ["--key-file", str(key_file)]
    assert main(["export", "--run", str(copy), "--out", str(out), *key_args]) == 0
    assert (
        load_exported(out, checkpoint_key(str(key_file))).metadata["isthmus.source"]
        == '{"origin": "final", "step": null}'
    )
    model = copy / "final" / "model.pt"
    state = torch.load(model, weights_only=True)
    state["norm.weight"] += 1.0  # other weights in a well-formed file
    torch.save(state, model)
    cli.readouterr()
    assert main(["generate", "--run", str(copy), "--max-new-tokens", "2"]) == 0  # without the key, nothing to check
    cli.readouterr()
    for command in (
        ["generate", "--run", str(copy), "--max-new-tokens", "2"],
        ["export", "--run", str(copy), "--out", str(out), "--overwrite"],
    ):
        assert main([*command, *key_args]) == 2
        assert "differs from its signed sha256; the final model was altered" in _error_line(cli.readouterr().err)
