"""Sample text from a trained run, so a user sees what the model learned.

The model is either form a run leaves: a run directory (its ``final/model.pt``, read with
``weights_only``) or a file written by `isthmus export` (safetensors). Neither unpickles objects.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import torch

from isthmus.data.tokenizer import Tokenizer, load_tokenizer
from isthmus.errors import IsthmusError
from isthmus.models.llama import Transformer, build_model
from isthmus.train.export import load_exported
from isthmus.train.final_model import load_final_state, load_model_args, verify_final_model

DEFAULT_CONTEXT = 256


def load_model(source: str | Path, key: bytes | None = None) -> tuple[Transformer, Tokenizer, int]:
    """The model (eval mode, CPU), its tokenizer and the sequence length it trained on.

    ``source`` is a run directory (its final model) or an exported ``.safetensors`` file; given
    ``key``, either must be signed with it.
    """
    path = Path(source)
    if path.is_file() or path.suffix == ".safetensors":
        exported = load_exported(path, key)
        return exported.build(), exported.tokenizer, _seq_len(exported.config)
    if not path.is_dir():
        raise IsthmusError(f"--run {path}: no such run directory")
    final = path / "final"
    verify_final_model(final, key)
    args = load_model_args(final)
    tokenizer = load_tokenizer(path)
    model = build_model(args, device="cpu")
    model.load_state_dict(load_final_state(final))
    return model.eval(), tokenizer, _trained_seq_len(path)


@torch.no_grad()
def generate(
    source: str | Path,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    context: int | None = None,
    key: bytes | None = None,
) -> str:
    """Continue ``prompt`` with the model of ``source`` (see `load_model`); returns prompt + continuation."""
    model, tokenizer, trained = load_model(source, key)
    if context is None:
        context = trained
    ids = tokenizer.encode(prompt) or [0]
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.tensor([ids], dtype=torch.long)
    for _ in range(max_new_tokens):
        # No KV cache: the demo models are small and a full re-run of the window keeps this simple.
        logits = model(tokens[:, -context:])[0, -1].float()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        tokens = torch.cat([tokens, torch.tensor([[nxt]])], dim=1)
    return tokenizer.decode(tokens[0].tolist())


def _seq_len(config: dict[str, Any]) -> int:
    try:
        return int(config["train"]["seq_len"])
    except (KeyError, TypeError, ValueError):
        return DEFAULT_CONTEXT


def _trained_seq_len(run: Path) -> int:

    try:
        return _seq_len(tomllib.loads((run / "config.toml").read_text()))
    except (OSError, ValueError):
        return DEFAULT_CONTEXT
