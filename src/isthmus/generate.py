"""Sample text from a trained run, so a user sees what the model learned."""

from __future__ import annotations

from pathlib import Path

import torch

from isthmus.data.tokenizer import load_tokenizer
from isthmus.errors import IsthmusError
from isthmus.models.llama import build_model
from isthmus.train.final_model import load_final_state, load_model_args


@torch.no_grad()
def generate(
    run_dir: str | Path,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    context: int | None = None,
) -> str:
    """Continue ``prompt`` with the final model of ``run_dir``; returns prompt + continuation."""
    run = Path(run_dir)
    if not run.is_dir():
        raise IsthmusError(f"--run {run}: no such run directory")
    final = run / "final"
    args = load_model_args(final)
    tokenizer = load_tokenizer(run)
    model = build_model(args, device="cpu")
    model.load_state_dict(load_final_state(final))
    model.eval()
    if context is None:
        context = _trained_seq_len(run)
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


def _trained_seq_len(run: Path) -> int:
    import tomllib

    try:
        return int(tomllib.loads((run / "config.toml").read_text())["train"]["seq_len"])
    except (OSError, KeyError, ValueError):
        return 256
