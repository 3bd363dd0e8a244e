"""The final model of a run: a plain state dict plus its shape, loadable by one process.

Loading never unpickles arbitrary objects: ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from isthmus.errors import IsthmusError
from isthmus.models.args import ModelArgs

MODEL_FILE = "model.pt"
ARGS_FILE = "model_args.json"


def save_final_model(model: nn.Module, args: ModelArgs, directory: Path) -> Path:
    """Write ``model.pt`` and ``model_args.json`` into ``directory`` (written aside, then renamed)."""
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    tmp = directory / (MODEL_FILE + ".tmp")
    torch.save(state, tmp)
    tmp.replace(directory / MODEL_FILE)
    (directory / ARGS_FILE).write_text(json.dumps(args.__dict__, indent=1))
    return directory / MODEL_FILE


def load_model_args(directory: Path) -> ModelArgs:
    path = directory / ARGS_FILE
    try:
        return ModelArgs(**json.loads(path.read_text()))
    except FileNotFoundError:
        raise IsthmusError(f"{path}: missing; is this a finished isthmus run?") from None
    except (ValueError, TypeError) as e:
        raise IsthmusError(f"{path}: not a valid model description ({e})") from None


def load_final_state(directory: Path) -> dict[str, torch.Tensor]:
    path = directory / MODEL_FILE
    if not path.is_file():
        raise IsthmusError(f"{path}: missing; is this a finished isthmus run?")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several unrelated types for a damaged file
        raise IsthmusError(f"{path}: cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
