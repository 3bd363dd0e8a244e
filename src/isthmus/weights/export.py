"""One-file model export: a run's weights as safetensors that one process loads (`isthmus export`).

The source is a run's final model (``final/model.pt``) or one of its checkpoints, whatever layout
saved it (`load_model_weights` reads a sharded checkpoint whole). The file holds every tensor
once, by canonical name: a tied output head is the embedding, so it is stored as the embedding and
named in the metadata. The metadata (safetensors allows string values only, so each is JSON) also
holds the model shape, the run's resolved config, its tokenizer and a sha256 of the tensor data,
which is all `isthmus generate --model FILE` needs. Reading never unpickles anything.

With a key (``--key-file``, else ``$ISTHMUS_CHECKPOINT_KEY_FILE``) a checkpoint must carry a valid
signature to be exported, and the file is signed in turn: an HMAC-SHA256 over every ``isthmus.*``
metadata value, the tensors' sha256 among them, that `load_exported` checks when given the key.
"""

from __future__ import annotations

import errno
import hashlib
import json
import re
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from isthmus.checkpoint.manifest import committed_checkpoints, read_manifest, sign, signature_matches
from isthmus.checkpoint.state import load_model_weights
from isthmus.data.tokenizer import BPE_FILE, META_FILE, PretrainedTokenizer, Tokenizer, load_tokenizer
from isthmus.errors import CheckpointError, IsthmusError, UnsafeCheckpoint, is_no_space, no_space
from isthmus.log import get_logger
from isthmus.models.args import ModelArgs
from isthmus.models.llama import Transformer, build_model
from isthmus.models.pretrained import model_args_from_json
from isthmus.weights.final_model import ARGS_FILE, MODEL_FILE, load_final_model, verify_final_model

FORMAT_VERSION = "1"
_PREFIX = "isthmus."
_TIED_HEAD = {"output.weight": "tok_embeddings.weight"}
_SIGNATURE = _PREFIX + "hmac_sha256"


@dataclass
class ModelSource:
    """The weights to export and what describes them."""

    state: dict[str, torch.Tensor]
    args: ModelArgs
    config: dict[str, Any]
    """The run's resolved config (the TOML as a nested dict)."""
    origin: str
    """Where the weights came from: ``final`` or a checkpoint directory."""
    step: int | None
    """The checkpoint's step; None for the final model."""


@dataclass
class ExportedModel:
    """An exported file, read back: ready for ``build_model(args)`` + ``load_state_dict(state)``."""

    args: ModelArgs
    state: dict[str, torch.Tensor]
    """The full state dict, the tied head (if any) included again."""
    config: dict[str, Any]
    tokenizer: Tokenizer
    metadata: dict[str, str]

    def build(self) -> Transformer:
        """The model on the CPU with these weights, in eval mode."""
        model = build_model(self.args, device="cpu")
        try:
            model.load_state_dict(self.state)
        except RuntimeError as e:  # missing, unexpected or misshapen tensors
            raise IsthmusError(f"the exported tensors do not fit its model shape ({str(e).splitlines()[0]})") from None
        return model.eval()


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise IsthmusError(
            "safetensors is not installed (a dependency of isthmus): pip install -c constraints.txt -e ."
        ) from None
    return safetensors.torch


# --- the source ------------------------------------------------------------------------------------
def _run_config(run: Path) -> dict[str, Any]:
    path = run / "config.toml"
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise IsthmusError(f"{path}: missing; is {run} an isthmus run directory?") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise IsthmusError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None


def _checkpoint_root(run: Path, config: dict[str, Any]) -> Path:
    configured = config.get("checkpoint", {}).get("dir", "")
    return Path(configured) if configured else run / "checkpoints"


def _from_checkpoint(directory: Path, key: bytes | None) -> ModelSource:

    manifest = read_manifest(directory, key)
    try:
        args = ModelArgs(**manifest.model)
        config = tomllib.loads(manifest.config)
    except (TypeError, tomllib.TOMLDecodeError) as e:
        raise CheckpointError(f"{directory}: its manifest describes no model ({type(e).__name__}: {e})") from None
    # load_model_weights verifies every file against the manifest before it reads one.
    return ModelSource(load_model_weights(directory, key), args, config, str(directory), manifest.step)


def find_source(run: Path, checkpoint: str | None = None, key: bytes | None = None) -> ModelSource:
    """The weights of ``run``: its final model if it finished, else its newest good checkpoint.

    ``checkpoint = "latest"`` takes the newest good checkpoint even when the run finished; any other
    value is a checkpoint directory to take. Given ``key``, a checkpoint must be signed with it.
    """
    if not run.is_dir():
        raise IsthmusError(f"--run {run}: no such run directory")
    if checkpoint not in (None, "latest"):
        return _from_checkpoint(Path(checkpoint), key)
    config = _run_config(run)
    final = run / "final"
    if checkpoint is None and (final / MODEL_FILE).is_file() and (final / ARGS_FILE).is_file():
        verify_final_model(final, key)
        args, state = load_final_model(final)
        return ModelSource(state, args, config, "final", None)
    root = _checkpoint_root(run, config)
    # Like `find_latest_good`, but each candidate is verified once, by the load itself.
    for _, directory in committed_checkpoints(root):
        try:
            return _from_checkpoint(directory, key)
        except UnsafeCheckpoint:
            raise  # one that would run code is an attack to stop at, not damage to skip
        except CheckpointError as e:
            get_logger().warning("checkpoint skipped: %s", e)
    what = "no good checkpoint" if checkpoint else "no final model and no good checkpoint"
    raise IsthmusError(f"--run {run}: {what} in {root}; nothing to export")


# --- writing and reading ---------------------------------------------------------------------------
def _tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order: safetensors itself checks no data."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _tokenizer_record(run: Path) -> dict[str, Any]:
    """The run's tokenizer as JSON values: its metadata, plus the tokenizer.json document for BPE and a
    checkpoint's tokenizer (with its BOS/EOS ids)."""
    tokenizer = load_tokenizer(run)  # checks it is usable before anything is written
    record: dict[str, Any] = {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size}
    if tokenizer.kind in ("bpe", "hf"):
        record["bpe"] = (run / BPE_FILE).read_text()
    if isinstance(tokenizer, PretrainedTokenizer):
        record.update(bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    return record


def _signed_part(metadata: dict[str, str]) -> dict[str, str]:
    """Every metadata value but the signature: what the signature covers."""
    return {k: v for k, v in metadata.items() if k != _SIGNATURE}


def export_model(source: ModelSource, tokenizer: dict[str, Any], out: Path, key: bytes | None = None) -> dict[str, Any]:
    """Write ``source`` to the safetensors file ``out`` (aside, then renamed), signed with ``key`` if
    given; returns a summary."""
    st = _safetensors()
    tensors = {name: t.detach().contiguous() for name, t in source.state.items()}
    tied = {}
    if source.args.tie_embeddings:
        for alias, target in _TIED_HEAD.items():
            if alias in tensors and target in tensors:
                assert torch.equal(tensors[alias], tensors[target]), "a tied head differs from the embedding"
                del tensors[alias]
                tied[alias] = target
    metadata = {
        "format": "pt",
        _PREFIX + "format": FORMAT_VERSION,
        _PREFIX + "model_args": json.dumps(source.args.__dict__),
        _PREFIX + "config": json.dumps(source.config),
        _PREFIX + "tokenizer": json.dumps(tokenizer),
        _PREFIX + "tied": json.dumps(tied),
        _PREFIX + "source": json.dumps({"origin": source.origin, "step": source.step}),
        _PREFIX + "sha256": _tensor_digest(tensors),
    }
    if key is not None:
        metadata[_SIGNATURE] = sign(key, _signed_part(metadata))
    tmp = out.with_name(out.name + ".tmp")
    try:
        tmp.open("wb").close()  # an unwritable place fails here with the system's reason
        st.save_file(tensors, str(tmp), metadata=metadata)
        tmp.replace(out)
    except Exception as e:  # OSError, or safetensors' own error for a failed write
        tmp.unlink(missing_ok=True)
        raise write_failed(out, e) from None
    return export_summary(out, source, tensors, out)


_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
"""How safetensors' writer (Rust) reports a system error: only as text, ``... (os error 28)``."""


def write_failed(out: Path, e: Exception) -> IsthmusError:
    """The one line for an export that could not be written: a full disk is a run that failed
    (exit 3, as for the trainer's writes); else the system's reason, or the first line of
    safetensors' own error (bad input, exit 2)."""
    code = _RUST_OS_ERROR.search(str(e))
    if is_no_space(e) or (code is not None and int(code.group(1)) in (errno.ENOSPC, errno.EDQUOT)):
        return no_space("export", out, "--out")
    reason = e.strerror if isinstance(e, OSError) and e.strerror else (str(e).splitlines() or [type(e).__name__])[0]
    return IsthmusError(f"--out {out}: cannot be written ({reason})")


def refuse_existing(out: Path, overwrite: bool) -> None:
    """Refuse to replace what ``out`` already names unless told to: an export is never the only copy of
    a model, but what it would replace may be."""
    if out.exists() and not out.is_dir() and not overwrite:
        raise IsthmusError(f"--out {out}: exists; set --overwrite to replace it, or choose another")


def export_summary(out: Path, source: ModelSource, tensors: dict[str, torch.Tensor], weights: Path) -> dict[str, Any]:
    """What `isthmus export` prints of an export written to ``out`` (its weights in the file ``weights``)."""
    return {
        "out": out,
        "origin": source.origin,
        "step": source.step,
        "tensors": len(tensors),
        "parameters": sum(t.numel() for t in tensors.values()),
        "bytes": weights.stat().st_size,
    }


def export_run(
    run: str | Path,
    out: str | Path,
    checkpoint: str | None = None,
    key: bytes | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """`isthmus export`: the weights of ``run`` (see `find_source`) and its tokenizer into the file ``out``.

    Given ``key``, a checkpoint exported must be signed with it, and ``out`` is signed with it. An
    existing file ``out`` is replaced only with ``overwrite``."""
    run, out = Path(run), Path(out)
    if out.suffix != ".safetensors":
        raise IsthmusError(f"--out {out}: must end in .safetensors")
    if not out.parent.is_dir():
        raise IsthmusError(f"--out {out}: no such directory {out.parent}")
    refuse_existing(out, overwrite)
    source = find_source(run, checkpoint, key)
    return export_model(source, _tokenizer_record(run), out, key)


def _check_signature(path: Path, key: bytes, metadata: dict[str, str]) -> None:
    signature = metadata.get(_SIGNATURE)
    if signature is None:
        raise IsthmusError(f"{path}: not signed, and a checkpoint key is set: only files signed with that key load")
    if not signature_matches(key, _signed_part(metadata), signature):
        raise IsthmusError(f"{path}: signature mismatch (HMAC-SHA256); the file was altered or signed with another key")


def _tokenizer_from_record(record: dict[str, Any], path: Path) -> Tokenizer:
    # Written out and read back by `load_tokenizer`, so an export is checked like a run directory.
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        bpe = record.pop("bpe", None)
        (directory / META_FILE).write_text(json.dumps(record))
        if bpe is not None:
            (directory / BPE_FILE).write_text(bpe)
        try:
            return load_tokenizer(directory)
        except IsthmusError as e:
            raise IsthmusError(
                f"{path}: its tokenizer is unusable ({str(e).replace(str(directory), 'metadata')})"
            ) from None


def load_exported(path: str | Path, key: bytes | None = None) -> ExportedModel:
    """Read an exported file: tensors (checked against their sha256), shape, config, tokenizer.

    Given ``key``, the file must be signed with it."""
    st = _safetensors()

    path = Path(path)
    if not path.is_file():
        raise IsthmusError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
        state = st.load_file(str(path))
    except Exception as e:  # safetensors raises its own error type, and OSError / ValueError
        first = (str(e).strip().splitlines() or [""])[0]
        raise IsthmusError(f"{path}: not a readable safetensors file ({type(e).__name__}: {first})") from None
    if metadata.get(_PREFIX + "format") != FORMAT_VERSION:
        raise IsthmusError(f"{path}: not an isthmus export (no {_PREFIX}format = {FORMAT_VERSION} in its metadata)")
    if _tensor_digest(state) != metadata.get(_PREFIX + "sha256"):
        raise IsthmusError(
            f"{path}: checksum mismatch (the tensor data differs from its sha256); the file was altered or damaged"
        )
    if key is not None:
        _check_signature(path, key, metadata)
    try:
        args = model_args_from_json(metadata[_PREFIX + "model_args"], path)
        config = json.loads(metadata[_PREFIX + "config"])
        tied = json.loads(metadata[_PREFIX + "tied"])
        tokenizer_record = json.loads(metadata[_PREFIX + "tokenizer"])
    except (KeyError, ValueError, TypeError) as e:
        raise IsthmusError(f"{path}: damaged isthmus metadata ({type(e).__name__}: {e})") from None
    for alias, target in tied.items():
        if target not in state:
            raise IsthmusError(f"{path}: damaged isthmus metadata (tied {alias} names {target}, which the file lacks)")
        state[alias] = state[target]
    tokenizer = _tokenizer_from_record(tokenizer_record, path)
    return ExportedModel(args, state, config, tokenizer, metadata)
