"""Checkpoint files someone else wrote end in one line and exit code 2, never a traceback or a hang.

Each hostile checkpoint is the module's one trained run with one file replaced and its manifest
resealed (every sha256 recomputed, as anyone who can write the directory can do), so nothing but
the content gives it away. Loading must refuse it before the content does harm: a pickle in a data
file, metadata that claims a tensor or a storage larger than the files hold, manifest fields of the
wrong kind, RNG state that is not JSON. A key file that never ends is refused before any work.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_checkpoint_security import _error_line, _recompute_manifest, _RunsCode, _train_args, cli, marker, run, tmp
from torch.distributed.checkpoint import FileSystemReader

from isthmus.checkpoint import manifest as checkpoint_manifest
from isthmus.checkpoint.manifest import MANIFEST_FILE, checkpoint_key
from isthmus.cli import main
from isthmus.errors import ConfigError
from isthmus.log import setup_logging
from procs import run_isthmus

__all__ = [
    "cli",
    "marker",
    "run",
    "tmp",
]  # fixtures shared with test_checkpoint_security (each module trains its own run)

STEP = "step-000004"
DATA = "__0_0.distcp"


def _hostile_copy(run: Path, tmp_path: Path, change: Callable[[Path], None]) -> tuple[Path, Path]:
    """A copy of ``run`` whose newest checkpoint ``change`` edits, resealed; (run copy, checkpoint)."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    checkpoint = copy / "checkpoints" / STEP
    change(checkpoint)
    _recompute_manifest(checkpoint)
    return copy, checkpoint


def _resume(tmp: Path, copy: Path, cli: pytest.CaptureFixture[str], *extra: str) -> str:
    """``isthmus train --checkpoint.resume auto`` on ``copy``: exit code 2 and its one line."""
    cli.readouterr()
    assert main(_train_args(tmp, copy, "--train.steps", "6", "--checkpoint.resume", "auto", *extra)) == 2
    return _error_line(cli.readouterr().err)


def _edit_metadata(change: Callable[[Any], None]) -> Callable[[Path], None]:
    def edit(checkpoint: Path) -> None:
        metadata = FileSystemReader(str(checkpoint)).read_metadata()  # torch's reader: the file is genuine
        change(metadata)
        (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))

    return edit


# --- data files --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("zipped", "padded"), [(True, False), (False, False), (False, True)], ids=["zip", "legacy", "legacy_padded"]
)
def test_a_data_file_replaced_by_a_pickle_is_refused(
    run: Path, tmp: Path, tmp_path: Path, marker: Path, cli: pytest.CaptureFixture[str], zipped: bool, padded: bool
) -> None:
    """As saved, the file is shorter than the storages the metadata places in it. Padded to its old
    size, every storage lies inside it, and torch reads the first one as the pickle (its older,
    unzipped format: a zip would be found by its end, which the padding moves)."""

    def replace(checkpoint: Path) -> None:
        data = checkpoint / DATA
        size = data.stat().st_size
        buf = io.BytesIO()
        torch.save({"x": _RunsCode(marker)}, buf, _use_new_zipfile_serialization=zipped)
        payload = buf.getvalue()
        data.write_bytes(payload + b"\0" * (size - len(payload)) if padded else payload)

    copy, checkpoint = _hostile_copy(run, tmp_path, replace)
    line = _resume(tmp, copy, cli)
    if padded:
        assert f"{checkpoint / DATA}: refuses to load posix.system (a checkpoint holds data only)" in line, line
    else:
        assert f"{checkpoint / '.metadata'}: " in line and f"beyond the end of {DATA}" in line, line


def test_metadata_claiming_a_larger_tensor_is_refused(
    run: Path, tmp: Path, tmp_path: Path, cli: pytest.CaptureFixture[str]
) -> None:
    def claim(metadata: Any) -> None:
        metadata.state_dict_metadata["model.tok_embeddings.weight"].size = torch.Size([10**6, 64])

    copy, checkpoint = _hostile_copy(run, tmp_path, _edit_metadata(claim))
    line = _resume(tmp, copy, cli)
    assert f"{checkpoint / '.metadata'}: entry 'model.tok_embeddings.weight' claims shape (1000000, 64)" in line, line


def test_metadata_of_another_shape_is_refused_before_reading(
    run: Path, tmp: Path, tmp_path: Path, cli: pytest.CaptureFixture[str]
) -> None:
    """Consistent metadata (size, chunk and storage agree) of a shape this model does not have."""

    def shrink(metadata: Any) -> None:
        entry = metadata.state_dict_metadata["model.tok_embeddings.weight"]
        entry.size = entry.chunks[0].sizes = torch.Size([128, 64])

    copy, checkpoint = _hostile_copy(run, tmp_path, _edit_metadata(shrink))
    line = _resume(tmp, copy, cli)
    assert f"{checkpoint}: entry model.tok_embeddings.weight has shape (128, 64); this model's is (256, 64)" in line


def test_metadata_claiming_a_huge_storage_is_refused(
    run: Path, tmp: Path, tmp_path: Path, cli: pytest.CaptureFixture[str]
) -> None:
    def claim(metadata: Any) -> None:
        index = next(i for i in metadata.storage_data if i.fqn == "model.tok_embeddings.weight")
        metadata.storage_data[index].length = 10**13

    copy, checkpoint = _hostile_copy(run, tmp_path, _edit_metadata(claim))
    line = _resume(tmp, copy, cli)
    assert f"{checkpoint / '.metadata'}: " in line and f"beyond the end of {DATA}" in line, line


# --- manifest fields and the state files DCP holds as bytes --------------------------------------------
@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("files", {".metadata": "38915 bytes"}, "files entry .metadata"),
        ("sampler", {"epoch": "x"}, "sampler"),
        ("scheduler", [1, 2], "scheduler"),
        ("step", "four", "step"),
    ],
)
def test_manifest_fields_of_the_wrong_kind_are_refused(
    run: Path, tmp: Path, tmp_path: Path, cli: pytest.CaptureFixture[str], field: str, value: Any, rule: str
) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    checkpoint = copy / "checkpoints" / STEP
    path = checkpoint / MANIFEST_FILE
    body = json.loads(path.read_text())
    body[field] = value
    path.write_text(json.dumps(body))
    if field != "files":
        _recompute_manifest(checkpoint)
    else:  # _recompute_manifest rewrites the files' sizes: reseal only the manifest's own checksum
        import hashlib

        body.pop("manifest_sha256")
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        body["manifest_sha256"] = hashlib.sha256(canonical).hexdigest()
        path.write_text(json.dumps(body))
    # By path: auto would skip a bad checkpoint for the older good one.
    cli.readouterr()
    args = _train_args(tmp, copy, "--train.steps", "6", "--checkpoint.resume", str(checkpoint))
    assert main(args) == 2
    line = _error_line(cli.readouterr().err)
    assert f"{path}: " in line and rule in line, line


def test_rng_state_that_is_not_json_is_refused(
    run: Path, tmp: Path, tmp_path: Path, cli: pytest.CaptureFixture[str]
) -> None:
    """The RNG states are JSON bytes in a uint8 tensor: overwrite them in place with other bytes."""

    def garble(checkpoint: Path) -> None:
        metadata = FileSystemReader(str(checkpoint)).read_metadata()
        index = next(i for i in metadata.storage_data if i.fqn == "rng.rank0")
        info = metadata.storage_data[index]
        data = bytearray((checkpoint / DATA).read_bytes())
        stored = bytes(data[info.offset : info.offset + info.length])
        start = stored.index(b'{"torch"')
        data[info.offset + start : info.offset + start + 8] = b"\xff" * 8
        (checkpoint / DATA).write_bytes(bytes(data))

    copy, checkpoint = _hostile_copy(run, tmp_path, garble)
    line = _resume(tmp, copy, cli)
    assert f"{checkpoint}: rng.rank0 is not a saved RNG state" in line, line


# --- the key file ------------------------------------------------------------------------------------
def test_a_key_file_that_never_ends_or_is_too_long_is_refused(tmp_path: Path) -> None:
    most = checkpoint_manifest.MAX_KEY_BYTES
    long = tmp_path / "long.key"
    long.write_bytes(b"k" * (most + 1))
    with pytest.raises(ConfigError, match=rf"holds more than {most} bytes"):
        checkpoint_key(str(long))
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer
    for special in ("/dev/zero", "/dev/urandom", str(fifo)):
        with pytest.raises(ConfigError, match=rf"checkpoint.key_file = '{special}': is not a regular file"):
            checkpoint_key(special)


def test_a_key_file_that_never_ends_is_one_line_through_the_cli(tmp_path: Path) -> None:
    done = run_isthmus(
        *("train", "--config", "tiny", "--train.val_every", "0", "--train.batch_size", "8"),
        *("--train.seq_len", "32", "--data.max_bytes", "60000", "--train.run_dir", str(tmp_path / "run")),
        *("--checkpoint.key_file", "/dev/zero"),
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "isthmus: error: checkpoint.key_file = '/dev/zero': is not a regular file; "
        "a key is a file of 16 to 4096 bytes (e.g. head -c 32 /dev/urandom | base64 > FILE)"
    ), done.stderr
    assert not (tmp_path / "run").exists()


@pytest.fixture(autouse=True)
def _no_leftover_logging() -> Iterator[None]:
    yield
    setup_logging(console=False)


# --- the final model ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "rule"),
    [
        ({"n_layers": 5}, "n_layers = 5: the weights hold 4 layers"),
        ({"dim": "64"}, "dim = '64': must be a whole number"),
        (
            {"ffn_dim": 10**9},
            "model.pt's layers.0.feed_forward.w1.weight has shape (176, 64); model_args.json makes it (1000000000, 64)",
        ),
        ({"n_layers": 10**9}, "n_layers = 1000000000: the weights hold 4 layers"),
    ],
    ids=["one_layer_more", "string_dim", "huge_ffn", "huge_n_layers"],
)
def test_final_model_args_the_weights_do_not_have_are_refused(
    run: Path, tmp_path: Path, cli: pytest.CaptureFixture[str], change: dict[str, Any], rule: str
) -> None:
    """generate --run and export build the model model_args.json describes: checked against model.pt first."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    args_file = copy / "final" / "model_args.json"
    args_file.write_text(json.dumps({**json.loads(args_file.read_text()), **change}))
    for command in (
        ["generate", "--run", str(copy), "--max-new-tokens", "2"],
        ["export", "--run", str(copy), "--out", str(tmp_path / "model.safetensors")],
    ):
        cli.readouterr()
        assert main(command) == 2
        line = _error_line(cli.readouterr().err)
        assert f"{args_file}: {rule}" in line, line
