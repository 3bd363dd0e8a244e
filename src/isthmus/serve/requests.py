"""Prefill requests for ``bubbles.prefill``: a JSONL file, one request per line, read and checked
before any process starts (a bad line is one error naming it), and again by each rank once its
tokenizer has turned the prompts into ids.

A request may hold at most ``train.seq_len`` tokens, the serving model's context: the run's model
is trained at that length (and exported with it as its positions). With the run's own model a
prompt of that length costs at most one training sequence's forward pass, in time (the filler times
its longest prompt before the first step, and serves it in a bubble or after training) and in
memory (attention and logits over that many positions). The requests together may hold
what every local rank's copy of them leaves room for in memory. The file is read a line at a time,
so a huge file or line is refused at the line that passes a limit, without being read whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from isthmus.errors import ConfigError, DataError

TOKEN_BYTES = 36
"""What a rank holds per request token: a list slot (8 bytes) and a Python int (28 bytes)."""
LINE_BYTES_PER_TOKEN = 64
"""The longest a line may be per token its request may hold: a JSON-escaped byte (``\\u00ff``) takes
6 bytes and an id in a list with its separator at most 12; the rest is room for BPE tokens of many
bytes and for whitespace."""
LINE_BYTES_EXTRA = 1024
"""Room on a line for its id, the keys and the braces."""


@dataclass(frozen=True)
class RawRequest:
    """One line of the file: its line number, its id and either prompt text or token ids."""

    line: int
    id: str
    prompt: str | None
    tokens: list[int] | None


@dataclass(frozen=True)
class RequestLimits:
    """What a file of requests may hold."""

    max_tokens: int
    """Tokens of one request: ``train.seq_len``, the serving model's context."""
    max_total_tokens: int | None = None
    """Tokens of all requests together; None: not checked (a rank, after preflight checked them)."""
    total_rule: str = ""
    """Why ``max_total_tokens``, as the end of the error that names it."""

    @property
    def max_line_bytes(self) -> int:
        return LINE_BYTES_PER_TOKEN * self.max_tokens + LINE_BYTES_EXTRA


def check_request_length(where: str, request_id: str, n_tokens: int, limits: RequestLimits) -> None:
    """DataError unless a request of ``n_tokens`` has at least one token and at most the serving model's context."""
    if n_tokens < 1:
        raise DataError(f"{where}: request {request_id!r} has no tokens; a prompt needs at least one")
    if n_tokens > limits.max_tokens:
        raise DataError(
            f"{where}: request {request_id!r} has {n_tokens:,} tokens, more than train.seq_len = "
            f"{limits.max_tokens:,} (the serving model's context); shorten it or raise train.seq_len"
        )


def check_total_tokens(where: str, total: int, limits: RequestLimits) -> None:
    """DataError when the requests so far hold more tokens than ``limits`` lets all of them hold."""
    if limits.max_total_tokens is not None and total > limits.max_total_tokens:
        raise DataError(
            f"{where}: the requests up to here hold {total:,} tokens, more than {limits.max_total_tokens:,}: "
            f"{limits.total_rule}"
        )


def check_synthetic(spec: str, n: int, length: int, limits: RequestLimits) -> None:
    """ConfigError for ``synthetic:N:LEN`` prompts past the serving model's context, or more tokens in
    all than ``limits`` allows."""
    if length > limits.max_tokens:
        raise ConfigError(
            "bubbles.prefill",
            spec,
            f"LEN = {length:,} is more than train.seq_len = {limits.max_tokens:,} (the serving model's context)",
        )
    if limits.max_total_tokens is not None and n * length > limits.max_total_tokens:
        raise ConfigError(
            "bubbles.prefill",
            spec,
            f"{n * length:,} tokens, more than {limits.max_total_tokens:,}: {limits.total_rule}",
        )


def read_request_file(
    path: Path, vocab: int, limits: RequestLimits, count: Callable[[str], int] | None = None
) -> list[RawRequest]:
    """Requests of a JSONL file: ``{"id": ..., "prompt": "text"}`` or ``{"id": ..., "tokens": [ids]}``
    with every id in [0, vocab); DataError naming the first bad line.

    ``count`` gives a prompt's number of tokens where the tokenizer is known; without it a prompt's
    length is checked once it is tokenized (`check_request_length`), and its UTF-8 bytes, at least
    as many as a byte-level tokenizer gives it tokens, count towards the total."""
    return list(iter_request_file(path, vocab, limits, count))


def iter_request_file(
    path: Path, vocab: int, limits: RequestLimits, count: Callable[[str], int] | None = None
) -> Iterator[RawRequest]:
    """`read_request_file`'s requests one at a time, each checked before the next line is read."""
    seen: set[str] = set()
    total = 0
    try:
        with path.open("rb") as f:
            n = 0
            # Room past the limit for a line end (LF or CRLF): a line of exactly the limit still reads whole.
            while raw := f.readline(limits.max_line_bytes + 2):
                n += 1
                where = f"bubbles.prefill: {path}:{n}"
                if len(raw.rstrip(b"\r\n")) > limits.max_line_bytes:
                    raise DataError(
                        f"{where}: longer than {limits.max_line_bytes:,} bytes, the most a request of at most "
                        f"train.seq_len = {limits.max_tokens:,} tokens (the serving model's context) may take; "
                        "shorten it or raise train.seq_len"
                    )
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
                if not line.strip():
                    continue
                request = _parse_line(line, where, vocab, n)
                if request.id in seen:
                    raise DataError(f"{where}: id {request.id!r} appears twice")
                seen.add(request.id)
                if request.tokens is not None:
                    check_request_length(where, request.id, len(request.tokens), limits)
                    total += len(request.tokens)
                elif count is not None:
                    total += _checked_count(where, request, count, limits)
                else:
                    total += len((request.prompt or "").encode("utf-8"))
                check_total_tokens(where, total, limits)
                yield request
    except OSError as e:
        raise DataError(f"bubbles.prefill: cannot read {path}: {e.strerror or e}") from None
    if not seen:
        raise DataError(f"bubbles.prefill: {path} holds no requests")


def _checked_count(where: str, request: RawRequest, count: Callable[[str], int], limits: RequestLimits) -> int:
    n = count(request.prompt or "")
    check_request_length(where, request.id, n, limits)
    return n


def _parse_line(line: str, where: str, vocab: int, n: int) -> RawRequest:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(record, dict) or "id" not in record or ("prompt" in record) == ("tokens" in record):
        raise DataError(f'{where}: needs "id" and one of "prompt" (text) or "tokens" (a list of token ids)')
    request_id = record["id"]
    # A bool is an int to Python, and 1 and true would name the same request in the results.
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int)) or request_id == "":
        raise DataError(f'{where}: "id" must be a non-empty string or an integer, not {json.dumps(request_id)[:40]}')
    if "prompt" in record:
        if not isinstance(record["prompt"], str) or not record["prompt"]:
            raise DataError(f'{where}: "prompt" must be a non-empty string')
        return RawRequest(n, str(request_id), record["prompt"], None)
    tokens = record["tokens"]
    ok = isinstance(tokens, list) and tokens and all(type(t) is int and 0 <= t < vocab for t in tokens)
    if not ok:
        raise DataError(f'{where}: "tokens" must be a non-empty list of token ids in [0, {vocab})')
    return RawRequest(n, str(request_id), None, tokens)
