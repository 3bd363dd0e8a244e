"""The final model of a run: a plain state dict plus its shape, loadable by one process.

Loading never unpickles arbitrary objects: ``torch.load(weights_only=True)``. With a checkpoint key
(`checkpoint_key`) the directory also holds ``signature.json``: both files' sha256 and an
HMAC-SHA256 over them, which `verify_final_model` checks before `isthmus export` or
`isthmus generate` reads the model.
"""

from __future__ import annotations

import json
import re
from dataclasses import MISSING, fields
from pathlib import Path
from typing import BinaryIO, cast

import torch
import torch.distributed as dist
from torch import nn

from isthmus.checkpoint.manifest import file_digest, sign, signature_matches
from isthmus.errors import IsthmusError, full_disk_as, is_no_space, no_space
from isthmus.models.args import ModelArgs
from isthmus.models.llama import build_model, canonical_name

MODEL_FILE = "model.pt"
ARGS_FILE = "model_args.json"
SIGNATURE_FILE = "signature.json"


def gather_full_state(modules: list[nn.Module], world_size: int) -> dict[str, torch.Tensor]:
    """The whole model's state dict, unsharded, by canonical parameter name (complete on rank 0).

    Every rank takes the full tensors of its own parts (DTensors gathered over their mesh); pipeline
    stages hold different layers, so rank 0 then collects the parts of every rank. Meant for the
    final model of modest size; resumable training state goes to `isthmus.checkpoint.state` instead.
    """

    state: dict[str, torch.Tensor] = {}
    for module in modules:
        for name, value in module.state_dict().items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            state[canonical_name(name)] = full.detach().cpu()
    if world_size == 1:
        return state

    parts: list[dict[str, torch.Tensor]] | None = [{} for _ in range(world_size)] if dist.get_rank() == 0 else None
    # Only ranks whose state rank 0 lacks need to send; sending all keeps this one simple collective.
    dist.gather_object(state, parts, dst=0)
    if parts is None:
        return {}
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, value in part.items():
            merged.setdefault(name, value)
    return merged


def save_final_model(
    state: dict[str, torch.Tensor], args: ModelArgs, directory: Path, key: bytes | None = None
) -> Path:
    """Write ``model.pt`` (a full state dict) and ``model_args.json`` into ``directory`` (written aside, then
    renamed), and ``signature.json`` given ``key``.

    A write that fails leaves no ``model.pt.tmp`` behind; a full disk is one line naming the file.
    """
    with full_disk_as("final model", directory, "train.run_dir"):
        directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (MODEL_FILE + ".tmp")
    out: _WriteErrors | None = None
    try:
        with tmp.open("wb") as f:
            out = _WriteErrors(f)
            torch.save(state, cast(BinaryIO, out))  # torch.save needs only write() and flush()
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        # torch's zip writer reports a failed write as "unexpected pos", without the OSError under it.
        if is_no_space(e) or (out is not None and is_no_space(out.error)):
            raise no_space("final model", directory / MODEL_FILE, "train.run_dir") from None
        raise
    tmp.replace(directory / MODEL_FILE)
    with full_disk_as("final model", directory / ARGS_FILE, "train.run_dir"):
        (directory / ARGS_FILE).write_text(json.dumps(args.__dict__, indent=1))
        (directory / SIGNATURE_FILE).unlink(missing_ok=True)  # a stale one would describe other files
        if key is not None:
            body = _signed_body(directory)
            (directory / SIGNATURE_FILE).write_text(json.dumps({**body, "hmac_sha256": sign(key, body)}, indent=1))
    return directory / MODEL_FILE


def _signed_body(directory: Path) -> dict[str, dict[str, str]]:
    return {"sha256": {name: file_digest(directory / name)[1] for name in (MODEL_FILE, ARGS_FILE)}}


def verify_final_model(directory: Path, key: bytes | None) -> None:
    """Given ``key``, check ``signature.json`` against it and both files against their sha256 there."""
    if key is None:
        return
    path = directory / SIGNATURE_FILE
    try:
        saved = json.loads(path.read_text())
        signature = saved.pop("hmac_sha256")
    except FileNotFoundError:
        raise IsthmusError(f"{path}: missing: the final model is not signed, and a checkpoint key is set") from None
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise IsthmusError(f"{path}: not a valid signature ({type(e).__name__}: {e})") from None
    if not signature_matches(key, saved, signature):
        raise IsthmusError(f"{path}: signature mismatch (HMAC-SHA256); altered, or signed with another key")
    try:
        if _signed_body(directory) == saved:
            return
    except OSError:
        pass
    raise IsthmusError(
        f"{directory}: {MODEL_FILE} or {ARGS_FILE} differs from its signed sha256; the final model was altered"
    )


class _WriteErrors:
    """A file for torch.save that remembers the OSError of a failed write (torch replaces it by its own)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


_KINDS: dict[str, tuple[type, ...]] = {"int": (int,), "bool": (bool,), "float": (int, float)}
"""Python types a model_args.json value may have, by the field's annotation (a Literal alias: str)."""


def load_model_args(directory: Path) -> ModelArgs:
    path = directory / ARGS_FILE
    try:
        args = ModelArgs(**json.loads(path.read_text()))
    except FileNotFoundError:
        raise IsthmusError(f"{path}: missing; is this a finished isthmus run?") from None
    except (ValueError, TypeError) as e:
        raise IsthmusError(f"{path}: not a valid model description ({e})") from None
    for f in fields(ModelArgs):
        value, kinds = getattr(args, f.name), _KINDS.get(str(f.type), (str,))
        # bool is an int to isinstance; only the bool fields may be one.
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            what = "whole number" if kinds == (int,) else " or ".join(k.__name__ for k in kinds)
            raise IsthmusError(f"{path}: {f.name} = {value!r}: must be a {what}")
        # The sizes every model has are at least 1; optional counts (experts, a head width) 0 = unused.
        least = 1 if f.default is MISSING else 0
        if isinstance(value, int) and kinds == (int,) and value < least:
            raise IsthmusError(f"{path}: {f.name} = {value!r}: must be at least {least}")
    return args


def load_final_model(directory: Path) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """The final model's shape and weights, the weights checked to be that shape's.

    ``model_args.json`` decides how large a model `build_model` allocates, so it is held to what
    ``model.pt`` holds before any model is built: first its number of layers (a model on meta is
    built layer by layer), then every tensor's shape.
    """
    args, state = load_model_args(directory), load_final_state(directory)
    path = directory / ARGS_FILE
    layers = len({m.group(1) for name in state if (m := re.match(r"layers\.(\d+)\.", name))})
    if args.n_layers != layers:
        raise IsthmusError(f"{path}: n_layers = {args.n_layers}: the weights hold {layers} layers")
    expected = {name: tuple(t.shape) for name, t in build_model(args).state_dict().items()}
    for name in sorted(set(expected) | set(state)):
        saved = tuple(state[name].shape) if name in state else None
        if saved != expected.get(name):
            held = f"has shape {saved}" if saved is not None else "is missing"
            made = f"makes it {expected[name]}" if name in expected else "has no such tensor"
            raise IsthmusError(f"{path}: {MODEL_FILE}'s {name} {held}; {ARGS_FILE} {made}")
    return args, state


def load_final_state(directory: Path) -> dict[str, torch.Tensor]:
    path = directory / MODEL_FILE
    if not path.is_file():
        raise IsthmusError(f"{path}: missing; is this a finished isthmus run?")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several unrelated types for a damaged file
        raise IsthmusError(
            f"{path}: cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
