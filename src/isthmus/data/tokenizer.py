"""Tokenizers: UTF-8 bytes, byte-level BPE trained locally, a checkpoint's own, and raw ids.

Every tokenizer saves itself as ``tokenizer_meta.json`` (kind and vocabulary size) plus, for BPE and
a checkpoint's tokenizer (``data.tokenizer = "hf:PATH"``), the ``tokenizers`` library's
``tokenizer.json``; :func:`load_tokenizer` reads a run's tokenizer back.
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
HF_PREFIX = "hf:"
HF_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")
"""Files next to a checkpoint's tokenizer.json that a run keeps, so an HF export carries them on."""
SLOW_TOKENIZER_FILES = ("tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


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


def _byte_to_unicode() -> dict[int, str]:
    """The printable character byte-level BPE (GPT-2, `tokenizers`' ByteLevel) stands for each byte by:
    printable Latin-1 bytes themselves, the others 256 + n in order. `tokenizers` exposes only the
    alphabet as a set, not this order, so it is written out here."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(BYTE_VOCAB) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(BYTE_VOCAB + n) for n, b in enumerate(moved)}}


def byte_tokenizer_json() -> str:
    """The byte tokenizer as a ``tokenizer.json``: byte-level BPE without merges whose token for byte
    b has id b, so transformers encodes text to its UTF-8 bytes as `ByteTokenizer` does."""
    vocab = {char: b for b, char in _byte_to_unicode().items()}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


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


def _first_json(path: Path) -> dict:
    """A JSON object file, or {} when it is absent (plain JSON: reading it runs no code)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    return value if isinstance(value, dict) else {}


def _special_id(tok: HFTokenizer, folder: Path, role: str) -> int | None:
    """The id of the ``role`` ("bos" or "eos") token: named in tokenizer_config.json or
    special_tokens_map.json (a string or {"content": ...}), else ``{role}_token_id`` of config.json."""
    for name in HF_SIDE_FILES:
        token = _first_json(folder / name).get(f"{role}_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and tok.token_to_id(token) is not None:
            return tok.token_to_id(token)
    value = _first_json(folder / "config.json").get(f"{role}_token_id")
    if isinstance(value, list):  # several end tokens (chat models): the first ends a document
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def hf_tokenizer_file(spec: str) -> Path:
    """The tokenizer.json that ``data.tokenizer = "hf:PATH"`` names: PATH itself or PATH/tokenizer.json."""
    path = Path(spec.removeprefix(HF_PREFIX)).expanduser()
    if path.is_file():
        return path
    if not path.is_dir():
        raise DataError(f"data.tokenizer {spec!r}: no such folder or file")
    if (path / BPE_FILE).is_file():
        return path / BPE_FILE
    slow = [name for name in SLOW_TOKENIZER_FILES if (path / name).is_file()]
    if slow:
        raise DataError(
            f"data.tokenizer {spec!r}: {path / slow[0]} is a slow tokenizer and isthmus reads tokenizer.json only; "
            "write one with transformers' AutoTokenizer.from_pretrained(PATH).save_pretrained(PATH)"
        )
    raise DataError(f"data.tokenizer {spec!r}: {path} holds no {BPE_FILE}")


def parse_tokenizer_json(text: str) -> HFTokenizer:
    """A ``tokenizers`` tokenizer from its JSON document (no code runs), or one DataError line."""
    try:
        return HFTokenizer.from_str(text)
    except Exception as e:  # the library raises a bare Exception for malformed JSON
        raise DataError(f"not a valid tokenizers file ({(str(e).splitlines() or [repr(e)])[0]})") from None


class PretrainedTokenizer:
    """A checkpoint's ``tokenizer.json`` (`tokenizers`: JSON, no code runs) with its BOS and EOS tokens.

    A document is encoded as BOS + text + EOS (each when the checkpoint names it), the way Llama
    was pretrained; a prompt as BOS + text, as transformers' tokenizer gives it. The tokenizer's
    own post-processor is not applied, so BOS is never added twice.
    """

    kind = "hf"

    def __init__(self, text: str, bos_id: int | None, eos_id: int | None, side_files: dict[str, str]) -> None:
        """``text`` is the tokenizer.json document (parsed by `parse_tokenizer_json`)."""
        self._tok = parse_tokenizer_json(text)
        self._text = text
        self.bos_id, self.eos_id = bos_id, eos_id
        self.side_files = side_files
        # The largest id decides the embedding rows needed (added tokens may sit past the model's vocab).
        self.vocab_size: int = max(self._tok.get_vocab_size(), max(self._tok.get_vocab().values(), default=-1) + 1)

    @classmethod
    def from_spec(cls, spec: str) -> PretrainedTokenizer:
        """The tokenizer ``data.tokenizer = "hf:PATH"`` names; BOS/EOS from the files beside it."""
        file = hf_tokenizer_file(spec)
        folder = file.parent
        try:
            text = file.read_text(encoding="utf-8")
            tokenizer = cls(text, None, None, {})
        except (OSError, DataError) as e:
            reason = e.strerror if isinstance(e, OSError) else str(e)
            raise DataError(f"{file}: {reason}") from None
        tokenizer.side_files = {
            name: (folder / name).read_text(encoding="utf-8") for name in HF_SIDE_FILES if (folder / name).is_file()
        }
        tokenizer.bos_id = _special_id(tokenizer._tok, folder, "bos")
        tokenizer.eos_id = _special_id(tokenizer._tok, folder, "eos")
        return tokenizer

    def to_str(self) -> str:
        return self._text

    def token(self, i: int) -> str | None:
        """The text of the token with id ``i`` (None outside the vocabulary)."""
        return self._tok.id_to_token(i)

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def encode_document(self, text: str) -> list[int]:
        return self.encode(text) + ([self.eos_id] if self.eos_id is not None else [])

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode_document(text), dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, directory: Path) -> None:
        _write_atomic(Path(directory) / BPE_FILE, self._text)
        for name, text in self.side_files.items():
            _write_atomic(Path(directory) / name, text)
        meta = {"kind": self.kind, "vocab_size": self.vocab_size, "bos_id": self.bos_id, "eos_id": self.eos_id}
        _write_atomic(Path(directory) / META_FILE, json.dumps(meta) + "\n")

    @classmethod
    def from_run(cls, directory: Path, meta: dict) -> PretrainedTokenizer:
        """The tokenizer `save` wrote into ``directory`` (BOS/EOS ids from its metadata)."""
        path = Path(directory) / BPE_FILE
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise DataError(f"{path}: cannot be read ({e.strerror or e})") from None
        sides = {n: (directory / n).read_text(encoding="utf-8") for n in HF_SIDE_FILES if (directory / n).is_file()}
        try:
            return cls(text, meta.get("bos_id"), meta.get("eos_id"), sides)
        except DataError as e:
            raise DataError(f"{path}: {e}") from None


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
    if kind == "hf":
        return PretrainedTokenizer.from_run(Path(directory), meta)
    if kind == "bpe":
        bpe_path = Path(directory) / BPE_FILE
        if not bpe_path.is_file():
            raise DataError(f"{bpe_path}: BPE tokenizer file not found")
        tok = BPETokenizer.from_file(bpe_path)
        if tok.vocab_size != vocab_size:
            raise DataError(f"{bpe_path}: vocabulary {tok.vocab_size} does not match {META_FILE} ({vocab_size})")
        return tok
    raise DataError(f"{meta_path}: unknown tokenizer kind {kind!r} (expected 'byte', 'bpe', 'hf' or 'raw')")
