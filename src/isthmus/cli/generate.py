"""`isthmus generate`: sample text from a finished run or an exported file."""

from __future__ import annotations

import argparse
import sys

from isthmus.cli.common import KEY_HELP, LATEST_RUN
from isthmus.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser(
        "generate",
        help="sample text from a trained run, an exported model or a Hugging Face folder",
        description="Continue a prompt with a KV cache: positions run on past the trained length "
        "(up to 2**24, exact in fp32 RoPE), never restart.",
        allow_abbrev=False,
    )
    model = gen.add_mutually_exclusive_group()
    model.add_argument(
        "--run", help=f"run directory (train.run_dir of the run): its final model (default: {LATEST_RUN})"
    )
    model.add_argument(
        "--model",
        help="a .safetensors file written by isthmus export, or a Hugging Face Llama folder "
        "(config.json, safetensors, tokenizer.json; isthmus export --format hf writes one)",
    )
    gen.add_argument("--prompt", default="def ", help="text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=40)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--key-file", default="", metavar="FILE", help=KEY_HELP.format(what="an exported file"))


def run(ns: argparse.Namespace, rest: list[str]) -> int:
    if ns.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", ns.max_new_tokens, "must be at least 1")
    if ns.temperature < 0:
        raise ConfigError("--temperature", ns.temperature, "must be 0 (greedy) or positive")
    # Startup time: torch loads only once the arguments are known to be good.
    from isthmus.checkpoint.manifest import checkpoint_key
    from isthmus.serve.generate import generate

    key = checkpoint_key(ns.key_file, "--key-file")
    text = generate(
        ns.model or ns.run or LATEST_RUN, ns.prompt, ns.max_new_tokens, ns.temperature, ns.top_k, ns.seed, key=key
    )
    sys.stdout.write(text + "\n")
    return 0
