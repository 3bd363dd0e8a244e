"""`isthmus tokenize`: a text corpus as a pre-tokenised .bin file that ``data.path`` reads back."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from isthmus.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    tok = sub.add_parser(
        "tokenize",
        allow_abbrev=False,
        help="tokenise a text corpus once into a .bin file for big corpora (--data.path X --out FILE.bin)",
        description="Tokenise data.path with data.tokenizer (byte, bpe, or hf:PATH, a checkpoint's "
        "tokenizer.json: each document BOS + text + EOS) into FILE.bin, ids in uint16 or uint32 (the "
        "smallest that holds the vocabulary). Train on it with --data.path FILE.bin, the same "
        "--data.tokenizer and the --data.bin_dtype printed. Takes the data section's --data.KEY VALUE "
        "overrides (data.max_bytes applies: 0 reads everything).",
    )
    tok.add_argument("--out", required=True, help="the file to write, FILE.bin")


def run(ns: argparse.Namespace, rest: list[str]) -> int:
    from isthmus.config import build_config, parse_overrides

    overrides = parse_overrides(rest)
    for key, _ in overrides:
        if not key.startswith("data."):
            raise ConfigError(f"--{key}", "", "isthmus tokenize takes only --data.KEY overrides")
    cfg = build_config(None, overrides)
    out = Path(ns.out)
    if out.suffix != ".bin":
        raise ConfigError("--out", ns.out, "must end in .bin (data.path reads .bin files as token ids)")
    if not out.parent.is_dir():
        raise ConfigError("--out", ns.out, f"no such directory {out.parent}")
    from isthmus.data.corpus import write_token_bin
    from isthmus.log import setup_logging

    setup_logging()
    count, dtype = write_token_bin(cfg.data, out)
    sys.stdout.write(
        f"wrote {count:,} tokens ({dtype}) -> {out}; train on it with --data.path {out} "
        f"--data.bin_dtype {dtype} --data.tokenizer {cfg.data.tokenizer}\n"
    )
    return 0
