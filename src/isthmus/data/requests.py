"""Prefill requests for ``bubbles.prefill``: a JSONL file, one request per line, read and checked
before any process starts (a bad line is one error naming it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from isthmus.errors import DataError


@dataclass(frozen=True)
class RawRequest:
    """One line of the file: its id and either prompt text or token ids."""

    id: str
    prompt: str | None
    tokens: list[int] | None


def read_request_file(path: Path, vocab: int) -> list[RawRequest]:
    """Requests of a JSONL file: ``{"id": ..., "prompt": "text"}`` or ``{"id": ..., "tokens": [ids]}``
    with every id in [0, vocab); DataError naming the first bad line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"bubbles.prefill: cannot read {path}: {e}") from None
    out: list[RawRequest] = []
    seen: set[str] = set()
    for n, line in enumerate(lines, 1):
        if line.strip():
            out.append(_parse_line(line, f"bubbles.prefill: {path}:{n}", vocab))
            if out[-1].id in seen:
                raise DataError(f"bubbles.prefill: {path}:{n}: id {out[-1].id!r} appears twice")
            seen.add(out[-1].id)
    if not out:
        raise DataError(f"bubbles.prefill: {path} holds no requests")
    return out


def _parse_line(line: str, where: str, vocab: int) -> RawRequest:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(record, dict) or "id" not in record or ("prompt" in record) == ("tokens" in record):
        raise DataError(f'{where}: needs "id" and one of "prompt" (text) or "tokens" (a list of token ids)')
    if "prompt" in record:
        if not isinstance(record["prompt"], str) or not record["prompt"]:
            raise DataError(f'{where}: "prompt" must be a non-empty string')
        return RawRequest(str(record["id"]), record["prompt"], None)
    tokens = record["tokens"]
    ok = isinstance(tokens, list) and tokens and all(type(t) is int and 0 <= t < vocab for t in tokens)
    if not ok:
        raise DataError(f'{where}: "tokens" must be a non-empty list of token ids in [0, {vocab})')
    return RawRequest(str(record["id"]), None, tokens)
