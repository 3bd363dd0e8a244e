"""Training data: find and read the corpus, tokenise it once (cached), split train/validation.

The trainer calls :func:`prepare_data`. Text data is tokenised into a ``.npy`` cached under
``data.cache_dir`` keyed by the files' names, sizes and mtimes, ``data.max_bytes`` and the
tokenizer, so a second run (or every rank after the first) skips tokenisation. Pre-tokenised
``.bin`` data is memory-mapped, never copied.

With several ranks, let one rank call :func:`prepare_data` first and the rest after a barrier:
concurrent calls are safe (cache files are written atomically) but would each do the work.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from isthmus.config import DataConfig
from isthmus.data.tokenizer import (
    HF_PREFIX,
    BPETokenizer,
    ByteTokenizer,
    PretrainedTokenizer,
    RawTokenizer,
    Tokenizer,
    train_bpe,
)
from isthmus.errors import DataError
from isthmus.log import get_logger

DOC_SEPARATOR = "\n\n"
BINARY_SNIFF_BYTES = 8192
# Bump when the cached token layout changes, so stale caches are never read.
CACHE_VERSION = 1
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass
class PreparedData:
    """A tokenizer and the train/validation token streams it produced."""

    tokenizer: Tokenizer
    """Decodes the ids; for .bin data a ByteTokenizer (all ids < 256) or a RawTokenizer."""
    train: np.ndarray
    """Training tokens (1-D; a memmap for .bin data)."""
    val: np.ndarray
    """Validation tokens: the last data.val_fraction of the stream."""


def _describe(path: str) -> str:
    return f"data.path {path!r}" + ("" if path else " (the Python standard library)")


def default_cache_dir(cfg: DataConfig) -> Path:
    """cfg.cache_dir, or ~/.cache/isthmus when it is empty."""
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else Path.home() / ".cache" / "isthmus"


def stdlib_files() -> list[Path]:
    """The running interpreter's standard-library ``*.py`` files: a corpus every machine has."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning here, not filtering after, keeps a big site-packages from being walked at all.
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        rel = Path(dirpath).relative_to(root).as_posix()
        files.extend((f"{rel}/{name}", Path(dirpath) / name) for name in filenames if name.endswith(".py"))
    return [path for _, path in sorted(files)]


def _looks_binary(path: Path) -> bool:
    with path.open("rb") as f:
        return b"\0" in f.read(BINARY_SNIFF_BYTES)


def text_files(path: str) -> list[Path]:
    """The files a text corpus is read from: the stdlib for "", the file, or a folder's text files."""
    if not path:
        files = stdlib_files()
        if not files:
            raise DataError(f"{_describe(path)}: no .py files under {sysconfig.get_paths()['stdlib']}")
        return files
    p = Path(path)
    try:
        if p.is_file():
            if _looks_binary(p):
                raise DataError(f"{_describe(path)}: looks binary (NUL bytes); use data.format bin for token files")
            return [p]
        if not p.is_dir():
            raise DataError(f"{_describe(path)}: no such file or folder")
        files = []
        for dirpath, dirnames, filenames in os.walk(p):
            # Hidden folders are version control and tool state, not corpus.
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                f = Path(dirpath) / name
                if not name.startswith(".") and f.is_file() and not _looks_binary(f):
                    files.append(f)
    except OSError as e:
        raise DataError(f"{_describe(path)}: cannot read ({e.strerror or e})") from None
    if not files:
        raise DataError(f"{_describe(path)}: the folder has no text files")
    return sorted(files, key=lambda f: f.relative_to(p).as_posix())


def iter_documents(files: Sequence[Path], max_bytes: int) -> Iterator[str]:
    """Yield each file decoded as UTF-8, stopping after max_bytes in all (0 = no limit)."""
    remaining = max_bytes if max_bytes > 0 else None
    for f in files:
        if remaining == 0:
            return
        try:
            with f.open("rb") as fh:
                raw = fh.read() if remaining is None else fh.read(remaining)
        except OSError as e:
            raise DataError(f"data file {str(f)!r}: cannot read ({e.strerror or e})") from None
        if remaining is not None:
            remaining -= len(raw)
        if raw:
            yield raw.decode("utf-8", errors="replace")


def read_documents(path: str, max_bytes: int) -> list[str]:
    """The documents of data.path (see `text_files`), at most max_bytes of them (0 = no limit)."""
    docs = list(iter_documents(text_files(path), max_bytes))
    if not docs:
        raise DataError(f"{_describe(path)}: the corpus is empty")
    return docs


def corpus_key(files: Sequence[Path], max_bytes: int) -> str:
    """A hash of the corpus identity: file names, sizes and mtimes, and the byte limit."""
    h = hashlib.sha256(f"v{CACHE_VERSION} max_bytes={max_bytes} sep={DOC_SEPARATOR!r}\n".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def build_tokenizer(cfg: DataConfig, files: Sequence[Path]) -> Tokenizer:
    """The byte tokenizer, a checkpoint's (``hf:PATH``), or a BPE trained on these files (cached by
    corpus and vocab size)."""
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer.startswith(HF_PREFIX):
        return PretrainedTokenizer.from_spec(cfg.tokenizer)
    key = hashlib.sha256(f"{corpus_key(files, cfg.max_bytes)} vocab={cfg.bpe_vocab_size}".encode()).hexdigest()[:20]
    return train_bpe(iter_documents(files, cfg.max_bytes), cfg.bpe_vocab_size, default_cache_dir(cfg), key)


def token_dtype(vocab_size: int) -> type[np.unsignedinteger]:
    """The smallest unsigned dtype that holds every id of the vocabulary."""
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def _tokenizer_id(tokenizer: Tokenizer) -> str:
    if isinstance(tokenizer, BPETokenizer | PretrainedTokenizer):
        # Two BPEs of the same size can differ; hash the merges so caches never mix them up.
        specials = f" bos={getattr(tokenizer, 'bos_id', None)} eos={getattr(tokenizer, 'eos_id', None)}"
        return hashlib.sha256((tokenizer.to_str() + specials).encode()).hexdigest()[:20]
    return f"{tokenizer.kind}-{tokenizer.vocab_size}"


def _save_npy_atomic(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def token_chunks(cfg: DataConfig, tokenizer: Tokenizer, files: Sequence[Path]) -> Iterator[np.ndarray]:
    """The corpus's tokens in pieces: one per document for a checkpoint's tokenizer (BOS + text + EOS,
    as it was pretrained), else the documents joined by DOC_SEPARATOR and encoded as one text."""
    dtype = token_dtype(tokenizer.vocab_size)
    if isinstance(tokenizer, PretrainedTokenizer):
        for doc in iter_documents(files, cfg.max_bytes):
            yield tokenizer.encode_array(doc).astype(dtype, copy=False)
        return
    text = DOC_SEPARATOR.join(iter_documents(files, cfg.max_bytes))
    if text:
        yield tokenizer.encode_array(text).astype(dtype, copy=False)


def load_token_array(cfg: DataConfig, tokenizer: Tokenizer, files: Sequence[Path] | None = None) -> np.ndarray:
    """The whole text corpus as one 1-D token array, from the cache when it is there."""
    files = text_files(cfg.path) if files is None else files
    key = hashlib.sha256(
        f"{corpus_key(files, cfg.max_bytes)} {tokenizer.kind} {_tokenizer_id(tokenizer)}".encode()
    ).hexdigest()[:24]
    path = default_cache_dir(cfg) / "tokens" / f"{key}.npy"
    log = get_logger()
    if path.is_file():
        try:
            return np.load(path, mmap_mode="r")
        except (OSError, ValueError, EOFError) as e:
            log.warning("cached tokens %s are unreadable (%s); tokenising again", path, e)
    log.info("tokenising %d files with the %s tokenizer", len(files), tokenizer.kind)
    chunks = list(token_chunks(cfg, tokenizer, files))
    if not chunks:
        raise DataError(f"{_describe(cfg.path)}: the corpus is empty")
    tokens = np.concatenate(chunks)
    _save_npy_atomic(path, tokens)
    return tokens


def is_bin(cfg: DataConfig) -> bool:
    """Whether data.path is pre-tokenised ids rather than text."""
    return cfg.format == "bin" or (cfg.format == "auto" and Path(cfg.path).suffix == ".bin" and bool(cfg.path))


def load_bin(cfg: DataConfig) -> np.ndarray:
    """Memory-map a pre-tokenised file of data.bin_dtype ids (no copy)."""
    if not cfg.path:
        raise DataError("data.path '': data.format bin needs the path of a pre-tokenised file")
    path = Path(cfg.path)
    itemsize = np.dtype(cfg.bin_dtype).itemsize
    try:
        size = path.stat().st_size
    except OSError as e:
        raise DataError(f"{_describe(cfg.path)}: cannot read ({e.strerror or e})") from None
    if size % itemsize:
        raise DataError(
            f"{_describe(cfg.path)}: {size} bytes is not a multiple of {itemsize} (data.bin_dtype {cfg.bin_dtype})"
        )
    if size < 2 * itemsize:
        raise DataError(f"{_describe(cfg.path)}: {size // itemsize} tokens; a .bin file needs at least 2")
    return np.memmap(path, dtype=cfg.bin_dtype, mode="r")


def bin_tokenizer(tokens: np.ndarray) -> Tokenizer:
    """Bytes if every id fits in one, else raw ids (model.vocab_size must cover max id + 1)."""
    max_id = int(tokens.max())
    return ByteTokenizer() if max_id < 256 else RawTokenizer(vocab_size=max_id + 1)


def split_tokens(tokens: np.ndarray, cfg: DataConfig, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The first (1 - val_fraction) of the stream for training, the rest for validation."""
    n = len(tokens)
    n_val = int(n * cfg.val_fraction)
    train, val = tokens[: n - n_val], tokens[n - n_val :]
    if min(len(train), len(val)) < seq_len + 1:
        raise DataError(
            f"{_describe(cfg.path)}: {n} tokens is too few for train.seq_len {seq_len} with data.val_fraction "
            f"{cfg.val_fraction} (train {len(train)}, val {len(val)}; each needs at least {seq_len + 1})"
        )
    return train, val


def write_token_bin(cfg: DataConfig, out: Path) -> tuple[int, str]:
    """Tokenise data.path with data.tokenizer into the pre-tokenised file ``out`` that ``data.path``
    reads back (ids in the smallest dtype that holds the vocabulary, written document by document, so
    a corpus larger than memory works); returns (tokens, dtype name)."""
    files = text_files(cfg.path)
    tokenizer = build_tokenizer(cfg, files)
    dtype = np.dtype(token_dtype(tokenizer.vocab_size))
    count = 0
    tmp = out.with_name(out.name + ".tmp")
    try:
        with tmp.open("wb") as f:
            for chunk in token_chunks(cfg, tokenizer, files):
                f.write(chunk.astype(dtype, copy=False).tobytes())
                count += len(chunk)
        if count == 0:
            raise DataError(f"{_describe(cfg.path)}: the corpus is empty")
        tmp.replace(out)
    except OSError as e:
        raise DataError(f"--out {out}: cannot be written ({e.strerror or e})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return count, dtype.name


def bin_with_tokenizer(cfg: DataConfig, tokens: np.ndarray) -> Tokenizer:
    """A .bin file's tokenizer: the checkpoint's that data.tokenizer names (every id must be in its
    vocabulary), else bytes or raw ids (`bin_tokenizer`)."""
    if not cfg.tokenizer.startswith(HF_PREFIX):
        return bin_tokenizer(tokens)
    tokenizer = PretrainedTokenizer.from_spec(cfg.tokenizer)
    max_id = int(tokens.max())
    if max_id >= tokenizer.vocab_size:
        raise DataError(
            f"{_describe(cfg.path)}: id {max_id} is outside data.tokenizer {cfg.tokenizer!r}'s vocabulary "
            f"({tokenizer.vocab_size}); check data.bin_dtype ({cfg.bin_dtype})"
        )
    return tokenizer


def prepare_data(cfg: DataConfig, seq_len: int) -> PreparedData:
    """Read, tokenise (cached) and split data.path: the one data entry point of the trainer."""
    if is_bin(cfg):
        tokens = load_bin(cfg)
        tokenizer = bin_with_tokenizer(cfg, tokens)
    else:
        files = text_files(cfg.path)
        tokenizer = build_tokenizer(cfg, files)
        tokens = load_token_array(cfg, tokenizer, files)
    train, val = split_tokens(tokens, cfg, seq_len)
    get_logger().info(
        "data: %d train + %d val tokens, %s tokenizer (vocab %d)",
        len(train),
        len(val),
        tokenizer.kind,
        tokenizer.vocab_size,
    )
    return PreparedData(tokenizer=tokenizer, train=train, val=val)
