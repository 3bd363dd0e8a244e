"""Checkpoint directories on disk: the manifest, checksums, verification, discovery and pruning.

A checkpoint is a directory ``<checkpoint.dir>/step-000010/`` holding torch.distributed.checkpoint's
files (``__<rank>_0.distcp`` and ``.metadata``) and ``isthmus.json``, the manifest: the step, the
model shape, the layout it was saved under, the resolved config, the data-loader and LR-scheduler
state, and the size and sha256 of every other file, plus a sha256 of the manifest itself.

The sha256s catch accidents, not tampering: anyone who edits a file can recompute them. With a key
(`checkpoint_key`: ``checkpoint.key_file`` or the file ``$ISTHMUS_CHECKPOINT_KEY_FILE`` names), the
manifest also carries an HMAC-SHA256 of its canonical body, which lists every file's sha256, so
the whole directory is signed; verification with a key refuses a checkpoint whose HMAC is
missing or wrong.

It is written as ``step-000010.partial/`` and renamed only once every rank's files and the manifest
are on disk, so a directory without the suffix is complete unless damaged later; verification
catches that. Nothing here needs torch or a process group: rank 0 verifies, the others trust it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import shutil
import stat
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from isthmus.errors import CheckpointError, ConfigError
from isthmus.log import get_logger

MANIFEST_FILE = "isthmus.json"
DCP_METADATA_FILE = ".metadata"
FORMAT_VERSION = 1
PARTIAL_SUFFIX = ".partial"
_STEP_DIR = re.compile(r"step-(\d+)")
_CHUNK = 1 << 20
KEY_ENV = "ISTHMUS_CHECKPOINT_KEY_FILE"
MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 4096
"""A key file is a short secret: a longer file, or one that never ends (/dev/zero), is not one."""
_SIGNATURE = "manifest_hmac_sha256"


@dataclass
class Manifest:
    """What ``isthmus.json`` holds besides the file list (see the module doc)."""

    step: int
    """Optimizer steps taken when the checkpoint was saved."""
    model: dict[str, Any]
    """The model's `ModelArgs` fields: a checkpoint loads only into the same shape."""
    layout: dict[str, Any]
    """The parallel layout it was saved under (informative: any layout loads it)."""
    config: str
    """The resolved config of the run that saved it, as TOML."""
    sampler: dict[str, Any]
    """`BatchSampler.state_dict()`: a global sample count, independent of the data-parallel size."""
    scheduler: dict[str, Any]
    """The LR scheduler's ``state_dict()``."""
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    """File name -> {"bytes": size, "sha256": hex digest} for every file but the manifest."""
    hosts: list[str] = field(default_factory=list)
    """A checkpoint in per-host folders (`isthmus.checkpoint.hostlocal`): the host of each rank that
    saved it, and ``files`` lists this host's files only; empty (and not written) for one folder."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def file_digest(path: Path) -> tuple[int, str]:
    """Size in bytes and sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def checkpoint_key(key_file: str = "", option: str = "checkpoint.key_file") -> bytes | None:
    """The key that signs and verifies checkpoints: the file ``key_file`` (given as ``option``),
    else the file ``$ISTHMUS_CHECKPOINT_KEY_FILE`` names; None when neither is set (no signing).

    The key is the file's bytes without surrounding whitespace, at least `MIN_KEY_BYTES` of them; the
    file is a regular one of at most `MAX_KEY_BYTES`.
    """
    name, path = (option, key_file) if key_file else (KEY_ENV, os.environ.get(KEY_ENV, ""))
    if not path:
        return None
    rule = f"a key is a file of {MIN_KEY_BYTES} to {MAX_KEY_BYTES} bytes (e.g. head -c 32 /dev/urandom | base64 > FILE)"
    try:
        # Non-blocking: opening a FIFO would otherwise wait for a writer before fstat could refuse it.
        fd = os.open(Path(path).expanduser(), os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ConfigError(name, path, f"is not a regular file; {rule}")
            raw = f.read(MAX_KEY_BYTES + 1)  # the size stat reports may change while the file is read
    except OSError as e:
        raise ConfigError(name, path, f"cannot be read ({e.strerror or type(e).__name__})") from None
    if len(raw) > MAX_KEY_BYTES:
        raise ConfigError(name, path, f"holds more than {MAX_KEY_BYTES} bytes; {rule}")
    key = raw.strip()
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            name,
            path,
            f"holds {len(key)} bytes; a key needs at least {MIN_KEY_BYTES} (e.g. head -c 32 /dev/urandom | base64 > FILE)",
        )
    return key


def sign(key: bytes, body: dict[str, Any]) -> str:
    """HMAC-SHA256 of ``body`` as canonical JSON: the one signature of manifests, final models and exports."""
    return hmac.new(key, _canonical(body), hashlib.sha256).hexdigest()


def signature_matches(key: bytes, body: dict[str, Any], signature: Any) -> bool:
    """Whether ``signature`` is `sign` (key, body), compared in constant time."""
    return isinstance(signature, str) and hmac.compare_digest(signature, sign(key, body))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path, manifest: Manifest, key: bytes | None = None) -> None:
    """Checksum every file in ``directory`` and write the manifest there (aside, fsynced, renamed);
    signed with ``key`` if given."""
    manifest.files = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and not path.name.startswith(MANIFEST_FILE):
            size, sha = file_digest(path)
            manifest.files[path.name] = {"bytes": size, "sha256": sha}
    assert DCP_METADATA_FILE in manifest.files, f"{directory}: DCP wrote no {DCP_METADATA_FILE}"
    write_file_synced(directory / MANIFEST_FILE, manifest_text(manifest, key).encode())


def manifest_text(manifest: Manifest, key: bytes | None = None) -> str:
    """The manifest as its file holds it, ``files`` as given; signed with ``key`` if given."""
    body = {"format": FORMAT_VERSION, **asdict(manifest)}
    if not manifest.hosts:
        del body["hosts"]  # a checkpoint in one folder: its manifest as before the field existed
    signature = sign(key, body) if key is not None else None
    body["manifest_sha256"] = hashlib.sha256(_canonical(body)).hexdigest()
    if signature is not None:
        body[_SIGNATURE] = signature
    return json.dumps(body, indent=1)


def write_file_synced(path: Path, data: bytes) -> None:
    """``path`` holding ``data``, written aside, fsynced and renamed: a reader sees it whole or not at all."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def read_manifest(directory: Path, key: bytes | None = None) -> Manifest:
    """The manifest of ``directory``, checked against its own checksum and, given a key, its
    signature; CheckpointError if unusable."""
    path = directory / MANIFEST_FILE
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete (its save did not finish)")
    try:
        body = json.loads(path.read_text())
        expected = body.pop("manifest_sha256")
        signature = body.pop(_SIGNATURE, None)
        if hashlib.sha256(_canonical(body)).hexdigest() != expected:
            raise CheckpointError(f"{path}: checksum mismatch; the manifest was altered or damaged")
        if key is not None:
            _check_signature(path, key, body, signature)
        version = body.pop("format")
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"{path}: format {version!r} is not {FORMAT_VERSION}; saved by another isthmus version"
            )
        layout = body.get("layout")
        if isinstance(layout, dict) and "geo_sync" in layout:
            # Checkpoints saved before the manifest took the config's key name (geo.sync) read alike.
            layout["sync"] = layout.pop("geo_sync")
        manifest = Manifest(**body)
        _check_fields(path, manifest)
        return manifest
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a valid checkpoint manifest ({type(e).__name__}: {e})") from None


_FIELD_TYPES: dict[str, type] = {"step": int, "model": dict, "layout": dict, "config": str, "sampler": dict}
_FIELD_TYPES.update(scheduler=dict, files=dict, hosts=list)


def _check_fields(path: Path, manifest: Manifest) -> None:
    """Each field of the kind `Manifest` declares, and each file entry a bare name with a size and a sha256.

    The checksum proves only that the manifest is whole, not who wrote it: a field of another kind
    would otherwise fail wherever a resume or an export first uses it.
    """
    assert set(_FIELD_TYPES) == {f.name for f in fields(Manifest)}
    for name, kind in _FIELD_TYPES.items():
        value = getattr(manifest, name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CheckpointError(f"{path}: {name} is {_short(value)}; it must be a {_KIND_NAMES[kind]}")
    if manifest.step < 0:
        raise CheckpointError(f"{path}: step is {manifest.step}; it must be at least 0")
    for file, entry in manifest.files.items():
        # A bare name: verification reads every file listed, and must read only the checkpoint's own.
        if file in ("", ".", "..") or "/" in file or "\\" in file or file.startswith(MANIFEST_FILE):
            raise CheckpointError(f"{path}: files lists {file!r}, not a file of the checkpoint directory")
        size, sha = (entry.get("bytes"), entry.get("sha256")) if isinstance(entry, dict) else (None, None)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(sha, str):
            raise CheckpointError(
                f'{path}: files entry {file} is {_short(entry)}; it must be {{"bytes": size, "sha256": digest}}'
            )


_KIND_NAMES = {int: "whole number", dict: "JSON object", str: "string", list: "JSON array"}


def _short(value: Any, most: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= most else text[: most - 3] + "..."


def _check_signature(path: Path, key: bytes, body: dict[str, Any], signature: Any) -> None:
    if signature is None:
        raise CheckpointError(
            f"{path}: not signed, and a checkpoint key is set: only checkpoints signed with that key load"
        )
    if not signature_matches(key, body, signature):
        raise CheckpointError(
            f"{path}: signature mismatch (HMAC-SHA256); the checkpoint was altered or signed with another key"
        )


def check_model(manifest: Manifest, model: dict[str, Any], directory: Path) -> None:
    """CheckpointError naming each field where the checkpoint's model differs from ``model``."""
    diffs = [
        f"{key} {manifest.model.get(key)!r} vs {value!r}"
        for key, value in model.items()
        if manifest.model.get(key) != value
    ]
    if diffs:
        raise CheckpointError(
            f"{directory}: saved for another model shape ({', '.join(diffs)} in this run); resume with the same [model] settings"
        )


def verify_checkpoint(directory: Path, model: dict[str, Any] | None = None, key: bytes | None = None) -> Manifest:
    """Check a checkpoint before loading it: manifest (and its signature, given a key), every file's
    size and sha256, and (given) the model shape.

    Raises CheckpointError with one line naming the first file or field that is wrong.
    """
    manifest = read_manifest(directory, key)
    if DCP_METADATA_FILE not in manifest.files:
        raise CheckpointError(f"{directory / MANIFEST_FILE}: lists no {DCP_METADATA_FILE}; not a complete checkpoint")
    for name, entry in sorted(manifest.files.items()):
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing from the checkpoint")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"{path}: {size} bytes, the manifest says {entry['bytes']} (truncated or overwritten)"
            )
        if file_digest(path)[1] != entry["sha256"]:
            raise CheckpointError(
                f"{path}: checksum mismatch (sha256 differs from the manifest); the file was altered or damaged"
            )
    if model is not None:
        check_model(manifest, model, directory)
    return manifest


def committed_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every committed checkpoint under ``root``, newest step first; no verification."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(found, reverse=True)


def find_latest_good(
    root: Path, model: dict[str, Any] | None = None, key: bytes | None = None
) -> tuple[Path, Manifest] | None:
    """The newest checkpoint under ``root`` that verifies, and its manifest; None if there is none.

    Each bad one on the way is logged as a one-line warning naming the file.
    """

    for _, directory in committed_checkpoints(root):
        try:
            return directory, verify_checkpoint(directory, model, key)
        except CheckpointError as e:
            get_logger().warning("checkpoint skipped: %s", e)
    return None


def commit(partial: Path) -> Path:
    """Make a fully written ``step-N.partial`` visible as ``step-N`` (replacing a stale ``step-N`` if any)."""
    assert partial.name.endswith(PARTIAL_SUFFIX), partial
    final = partial.with_name(partial.name[: -len(PARTIAL_SUFFIX)])
    if final.exists():
        # Left by an earlier run that went further than the checkpoint this run resumed from.
        stale = final.with_name(final.name + ".stale")
        shutil.rmtree(stale, ignore_errors=True)
        final.rename(stale)
        partial.rename(final)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        partial.rename(final)
    _fsync_dir(final.parent)
    return final


def prune(root: Path, keep: int, protect: Path) -> list[Path]:
    """Delete all but the newest ``keep`` committed checkpoints, never ``protect``; returns what went."""
    removed = []
    for _, directory in committed_checkpoints(root)[keep:]:
        if directory != protect:
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed


def remove_partials(root: Path) -> list[Path]:
    """Delete the leftovers of saves that never committed (crashed runs); call before any save starts."""
    if not root.is_dir():
        return []
    leftovers = [p for p in root.iterdir() if p.is_dir() and p.name.endswith((PARTIAL_SUFFIX, ".stale"))]
    for p in leftovers:
        shutil.rmtree(p, ignore_errors=True)
    return leftovers


def resume_note(root: Path, every: int) -> str:
    """What a new run can start from: the newest committed checkpoint under ``root``, or nothing."""
    committed = committed_checkpoints(root)
    newest = committed[0][0] if committed else 0
    cut = [p for p in uncommitted_saves(root) if p[0] > newest]
    cut_note = f" (the save of step {cut[0][0]} was cut short and stays uncommitted)" if cut else ""
    if committed:
        step, path = committed[0]
        return f"the newest checkpoint is {path} (step {step}){cut_note}: continue with --checkpoint.resume {path}"
    if every == 0:
        return "nothing to resume from (checkpoint.every = 0): a new run starts over"
    return f"no checkpoint was saved yet (checkpoint.every = {every}){cut_note}: a new run starts over"


def uncommitted_saves(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of the saves under ``root`` that never committed (``step-N.partial``), newest first."""
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.fullmatch(p.name.removesuffix(PARTIAL_SUFFIX))) and p.name.endswith(PARTIAL_SUFFIX)
    ]
    return sorted(found, reverse=True)
