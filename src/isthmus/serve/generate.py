"""Sample text from a trained run or a checkpoint, so a user sees what the model learned.

The model is any form isthmus reads: a run directory (its ``final/model.pt``, read with
``weights_only``), a file written by `isthmus export` (safetensors), or a Hugging Face Llama folder
(config.json + safetensors, with its tokenizer.json). None of them unpickles objects.

Decoding keeps a KV cache (`isthmus.models.llama.KVCache`): the prompt runs once, then each new
token alone, at the next position. Positions never restart, so a sequence may run past the
trained length; RoPE angles are computed per position in fp32 (no table to outgrow), exact for
integer positions up to `MAX_POSITIONS`, the limit a request is checked against.
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from isthmus.data.tokenizer import BPE_FILE, HF_PREFIX, PretrainedTokenizer, Tokenizer, load_tokenizer
from isthmus.errors import ConfigError, IsthmusError
from isthmus.models.llama import KVCache, Transformer, build_model
from isthmus.models.pretrained import init_source_args, is_hf_folder
from isthmus.weights.export import load_exported
from isthmus.weights.final_model import load_final_model, verify_final_model
from isthmus.weights.init_from import load_weights, open_weights

DEFAULT_CONTEXT = 256
MAX_POSITIONS = 2**24
"""fp32 holds every integer position exactly up to 2**24; past it neighbouring positions share an angle."""


def load_model(source: str | Path, key: bytes | None = None) -> tuple[Transformer, Tokenizer, int]:
    """The model (eval mode, CPU), its tokenizer and the sequence length it trained on.

    ``source`` is a run directory (its final model), an exported ``.safetensors`` file or a Hugging
    Face Llama folder; given ``key``, a run's final model or an exported file must be signed with it.
    """
    path = Path(source)
    if is_hf_folder(path):
        return _load_hf_folder(path)
    if path.is_file() or path.suffix == ".safetensors":
        exported = load_exported(path, key)
        return exported.build(), exported.tokenizer, _seq_len(exported.config)
    if not path.is_dir():
        raise IsthmusError(f"--run {path}: no such run directory")
    final = path / "final"
    verify_final_model(final, key)
    args, state = load_final_model(final)
    tokenizer = load_tokenizer(path)
    model = build_model(args, device="cpu")
    model.load_state_dict(state)
    return model.eval(), tokenizer, _trained_seq_len(path)


def _load_hf_folder(path: Path) -> tuple[Transformer, Tokenizer, int]:
    """A Hugging Face Llama folder (or `isthmus export --format hf` output) with its tokenizer.json."""
    if not (path / BPE_FILE).is_file():
        raise IsthmusError(f"--model {path}: a Hugging Face folder without {BPE_FILE}; generate needs its tokenizer")
    tokenizer = PretrainedTokenizer.from_spec(HF_PREFIX + str(path))
    args = init_source_args(str(path))
    model = build_model(args, device="cpu")
    load_weights([model], open_weights(str(path), args))
    return model.eval(), tokenizer, DEFAULT_CONTEXT


def check_positions(prompt_len: int, max_new_tokens: int) -> None:
    """Refuse a request whose last position RoPE cannot tell from its neighbour (see `MAX_POSITIONS`)."""
    if prompt_len + max_new_tokens > MAX_POSITIONS:
        raise ConfigError(
            "--max-new-tokens",
            max_new_tokens,
            f"prompt ({prompt_len} tokens) + new tokens exceed {MAX_POSITIONS:,} positions (exact in fp32 RoPE)",
        )


def _next_token(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))


@torch.no_grad()
def generate_ids(
    model: Transformer,
    ids: Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    stop_id: int | None = None,
) -> list[int]:
    """``ids`` and up to ``max_new_tokens`` more (greedy at temperature 0), through a KV cache; stops
    after ``stop_id`` when given."""
    check_positions(len(ids), max_new_tokens)
    generator = generator or torch.Generator().manual_seed(0)
    cache = KVCache()
    out = list(ids)
    logits = model(torch.tensor([out], dtype=torch.long), cache=cache)[0, -1].float()
    for step in range(max_new_tokens):
        nxt = _next_token(logits, temperature, top_k, generator)
        out.append(nxt)
        if nxt == stop_id or step == max_new_tokens - 1:
            break
        logits = model(torch.tensor([[nxt]], dtype=torch.long), cache=cache)[0, -1].float()
    return out


def generate(
    source: str | Path,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    key: bytes | None = None,
) -> str:
    """Continue ``prompt`` with the model of ``source`` (see `load_model`); returns prompt + continuation
    (a checkpoint tokenizer's sequence stops at its EOS)."""
    model, tokenizer, _ = load_model(source, key)
    ids = tokenizer.encode(prompt) or [0]
    stop = tokenizer.eos_id if isinstance(tokenizer, PretrainedTokenizer) else None
    generator = torch.Generator().manual_seed(seed)
    return tokenizer.decode(generate_ids(model, ids, max_new_tokens, temperature, top_k, generator, stop))


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
