"""Tokenizers: UTF-8 bytes, byte-level BPE trained locally, and raw ids for pre-tokenised data.

Every tokenizer saves itself as ``tokenizer_meta.json`` (kind and vocabulary size) plus, for BPE,
the ``tokenizers`` library's ``tokenizer.json``; :func:`load_tokenizer` reads a run's tokenizer back.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from isthmus.errors import DataError
from isthmus.log import get_logger

META_FILE = "tokenizer_meta.json"
BPE_FILE = "tokenizer.json"
BYTE_VOCAB = 256


@runtime_checkable
class Tokenizer(Protocol):
    """What the trainer and `isthmus generate` need from a tokenizer."""

    kind: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def encode_array(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def save(self, directory: Path) -> None: ...


def _write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so concurrent ranks never read half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_meta(directory: Path, kind: str, vocab_size: int) -> None:
    _write_atomic(Path(directory) / META_FILE, json.dumps({"kind": kind, "vocab_size": vocab_size}) + "\n")


class ByteTokenizer:
    """One token per UTF-8 byte: no training, no unknown tokens, vocabulary 256."""

    kind = "byte"
    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        # frombuffer avoids building a Python int per byte, which dominates on multi-MB corpora.
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids: Sequence[int]) -> str:
        # A sampled sequence can stop mid-character; replace rather than fail.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def save(self, directory: Path) -> None:
        _write_meta(directory, self.kind, self.vocab_size)


class RawTokenizer:
    """Ids of pre-tokenised data whose tokenizer is not known: text is ids written as decimal numbers.

    ``model.vocab_size`` must be at least ``vocab_size`` (the largest id in the data plus one).
    """

    kind = "raw"

    def __init__(self, vocab_size: int) -> None:
        assert vocab_size >= 1, vocab_size
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(tok) for tok in text.split()]
        except ValueError:
            raise DataError(f"raw tokenizer: prompt {text[:40]!r} must be token ids separated by spaces") from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise DataError(f"raw tokenizer: id {bad[0]} is outside the vocabulary 0..{self.vocab_size - 1}")
        return ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def save(self, directory: Path) -> None:
        _write_meta(directory, self.kind, self.vocab_size)


class BPETokenizer:
    """Byte-level BPE from the `tokenizers` library; the 256 byte tokens mean any text encodes."""

    kind = "bpe"

    def __init__(self, tok: HFTokenizer) -> None:
        self._tok = tok
        self.vocab_size: int = tok.get_vocab_size()

    @classmethod
    def from_file(cls, path: Path) -> BPETokenizer:
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:  # the library raises a bare Exception for malformed JSON
            first_line = (str(e).splitlines() or [repr(e)])[0]
            raise DataError(f"{path}: not a valid tokenizers file ({first_line})") from None

    def to_str(self) -> str:
        """The tokenizer as the `tokenizers` JSON document (used to fingerprint caches)."""
        return self._tok.to_str()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, directory: Path) -> None:
        _write_atomic(Path(directory) / BPE_FILE, self._tok.to_str())
        _write_meta(directory, self.kind, self.vocab_size)


def _new_bpe_trainer(vocab_size: int) -> tuple[HFTokenizer, trainers.BpeTrainer]:
    tok = HFTokenizer(models.BPE())
    # add_prefix_space=False keeps decode(encode(text)) == text exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    return tok, trainer


def train_bpe(texts: Iterable[str], vocab_size: int, cache_dir: Path, key: str) -> BPETokenizer:
    """Train a byte-level BPE on texts, or load the one cached under ``cache_dir/bpe/<key>``.

    The caller makes ``key`` from the corpus identity and vocab size; texts is only consumed
    on a cache miss, so a lazy generator costs nothing when the tokenizer is cached.
    """
    path = Path(cache_dir) / "bpe" / key / BPE_FILE
    log = get_logger()
    if path.is_file():
        try:
            tok = BPETokenizer.from_file(path)
            log.debug("loaded cached BPE tokenizer %s", path)
            return tok
        except DataError:
            log.warning("cached BPE tokenizer %s is unreadable; retraining", path)
    log.info("training a byte-level BPE tokenizer with vocab %d (cached at %s)", vocab_size, path.parent)
    hf, trainer = _new_bpe_trainer(vocab_size)
    hf.train_from_iterator(texts, trainer=trainer)
    tok = BPETokenizer(hf)
    tok.save(path.parent)
    return tok


def load_tokenizer(directory: Path) -> Tokenizer:
    """Read the tokenizer that `Tokenizer.save` wrote into directory (a run directory)."""
    meta_path = Path(directory) / META_FILE
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        kind, vocab_size = meta["kind"], int(meta["vocab_size"])
    except FileNotFoundError:
        raise DataError(f"{meta_path}: tokenizer metadata not found") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{meta_path}: corrupt tokenizer metadata ({type(e).__name__}: {e})") from None
    if kind == "byte":
        return ByteTokenizer()
    if kind == "raw":
        return RawTokenizer(vocab_size)
    if kind == "bpe":
        bpe_path = Path(directory) / BPE_FILE
        if not bpe_path.is_file():
            raise DataError(f"{bpe_path}: BPE tokenizer file not found")
        tok = BPETokenizer.from_file(bpe_path)
        if tok.vocab_size != vocab_size:
            raise DataError(f"{bpe_path}: vocabulary {tok.vocab_size} does not match {META_FILE} ({vocab_size})")
        return tok
    raise DataError(f"{meta_path}: unknown tokenizer kind {kind!r} (expected 'byte', 'bpe' or 'raw')")
