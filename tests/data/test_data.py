"""Data package: tokenizers, corpus reading and caching, .bin memmaps, the resumable sampler."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from isthmus.config import DataConfig
from isthmus.data import corpus, tokenizer
from isthmus.data.corpus import load_token_array, prepare_data, read_documents, stdlib_files, text_files
from isthmus.data.loader import BatchSampler, val_batches
from isthmus.data.tokenizer import BPETokenizer, ByteTokenizer, RawTokenizer, load_tokenizer, train_bpe
from isthmus.errors import DataError

TEXT = "def add(a, b):\n    return a + b  # Grüße, 日本語, emoji 🙂\n\n" * 40


def one_line_error(exc: pytest.ExceptionInfo[DataError]) -> str:
    msg = str(exc.value)
    assert msg and "\n" not in msg
    return msg


def test_byte_round_trip_non_ascii(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert max(ids) < 256 and tok.decode(ids) == TEXT
    assert np.array_equal(tok.encode_array(TEXT), np.asarray(ids))
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # a cut-off character decodes, replaced
    tok.save(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)


def test_bpe_trains_round_trips_and_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = train_bpe([TEXT], 300, tmp_path, "k1")
    assert isinstance(tok, BPETokenizer) and tok.vocab_size <= 300
    ids = tok.encode(TEXT)
    assert len(ids) < len(TEXT.encode()) and tok.decode(ids) == TEXT
    unseen = "zqx ¿? \x00\t€"  # bytes never seen in training still encode via the byte alphabet
    assert tok.decode(tok.encode(unseen)) == unseen
    cached = tmp_path / "bpe" / "k1" / "tokenizer.json"
    assert cached.is_file()

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("retrained despite the cache")

    monkeypatch.setattr(tokenizer, "_new_bpe_trainer", no_training)
    again = train_bpe(iter(()), 300, tmp_path, "k1")
    assert again.encode(TEXT) == ids

    run = tmp_path / "run"
    tok.save(run)
    meta = json.loads((run / "tokenizer_meta.json").read_text())
    assert meta == {"kind": "bpe", "vocab_size": tok.vocab_size}
    assert load_tokenizer(run).encode(TEXT) == ids


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="tokenizer_meta.json") as e:
        load_tokenizer(tmp_path)
    one_line_error(e)
    (tmp_path / "tokenizer_meta.json").write_text("{not json")
    with pytest.raises(DataError, match="corrupt") as e:
        load_tokenizer(tmp_path)
    one_line_error(e)
    (tmp_path / "tokenizer_meta.json").write_text('{"kind": "bpe", "vocab_size": 300}')
    (tmp_path / "tokenizer.json").write_text("garbage")
    with pytest.raises(DataError, match="tokenizer.json") as e:
        load_tokenizer(tmp_path)
    one_line_error(e)


def test_stdlib_corpus_nonempty_and_deterministic() -> None:
    files = stdlib_files()
    assert files == stdlib_files() and len(files) > 100
    assert not any("site-packages" in f.parts or "dist-packages" in f.parts for f in files)
    docs = read_documents("", 200_000)
    assert docs == read_documents("", 200_000)
    assert sum(len(d.encode()) for d in docs) <= 200_000 + 3 * len(docs)  # replacement chars may grow it


def test_folder_reading_skips_binary_and_hidden(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b" / "c.md").write_text("gamma")
    (tmp_path / "blob.dat").write_bytes(b"abc\0def")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref")
    assert [f.name for f in text_files(str(tmp_path))] == ["a.txt", "c.md"]
    assert read_documents(str(tmp_path), 0) == ["alpha", "gamma"]
    assert read_documents(str(tmp_path), 7) == ["alpha", "ga"]  # the last document is truncated


def test_bad_text_inputs_raise_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no text files") as e:
        read_documents(str(empty), 0)
    one_line_error(e)
    (tmp_path / "zero.txt").write_text("")
    with pytest.raises(DataError, match="empty") as e:
        read_documents(str(tmp_path / "zero.txt"), 0)
    one_line_error(e)
    with pytest.raises(DataError, match="no such"):
        read_documents(str(tmp_path / "missing"), 0)


def test_text_tokens_are_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "corpus.txt").write_text(TEXT)
    cfg = DataConfig(path=str(tmp_path / "corpus.txt"), cache_dir=str(tmp_path / "cache"))
    first = load_token_array(cfg, ByteTokenizer())
    assert first.dtype == np.uint16 and ByteTokenizer().decode(first.tolist()) == TEXT
    assert len(list((tmp_path / "cache" / "tokens").glob("*.npy"))) == 1
    monkeypatch.setattr(corpus, "iter_documents", lambda *a: pytest.fail("retokenised despite the cache"))
    assert np.array_equal(load_token_array(cfg, ByteTokenizer()), first)


def test_prepare_text_bpe_split(tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_text(TEXT * 5)
    cfg = DataConfig(path=str(tmp_path / "corpus.txt"), tokenizer="bpe", bpe_vocab_size=300, cache_dir=str(tmp_path))
    data = prepare_data(cfg, seq_len=16)
    assert data.tokenizer.kind == "bpe"
    assert data.tokenizer.decode(np.concatenate([data.train, data.val]).tolist()) == TEXT * 5
    assert len(data.val) == int((len(data.train) + len(data.val)) * cfg.val_fraction)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_memmap(tmp_path: Path, dtype: str) -> None:
    ids = (np.arange(4000) * 7919 % 70_000).astype(dtype) if dtype == "uint32" else np.arange(4000).astype(dtype)
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    data = prepare_data(DataConfig(path=str(path), bin_dtype=dtype), seq_len=32)  # type: ignore[arg-type]
    assert isinstance(data.train, np.memmap) and data.train.dtype == np.dtype(dtype)
    assert np.array_equal(np.concatenate([data.train, data.val]), ids)
    assert isinstance(data.tokenizer, RawTokenizer) and data.tokenizer.vocab_size == int(ids.max()) + 1
    assert data.tokenizer.decode([3, 4]) == "3 4"

    small = tmp_path / "bytes.bin"
    (np.arange(1000) % 256).astype(np.uint16).tofile(small)
    assert isinstance(prepare_data(DataConfig(path=str(small)), seq_len=8).tokenizer, ByteTokenizer)


def test_bad_bin_inputs_raise_one_line(tmp_path: Path) -> None:
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\1\0\2")
    with pytest.raises(DataError, match="not a multiple of 2") as e:
        prepare_data(DataConfig(path=str(odd)), seq_len=8)
    one_line_error(e)
    few = tmp_path / "few.bin"
    np.arange(100, dtype=np.uint16).tofile(few)
    with pytest.raises(DataError, match="100 tokens is too few for train.seq_len 128") as e:
        prepare_data(DataConfig(path=str(few)), seq_len=128)
    one_line_error(e)


def test_sampler_seeded_and_resumable() -> None:
    tokens = np.arange(10_001, dtype=np.uint16)
    a, b, c = BatchSampler(tokens, 10, seed=1), BatchSampler(tokens, 10, seed=1), BatchSampler(tokens, 10, seed=2)
    xa, ya = a.next_batch(8)
    xb, _ = b.next_batch(8)
    assert torch.equal(xa, xb) and not torch.equal(xa, c.next_batch(8)[0])
    assert xa.shape == ya.shape == (8, 10) and xa.dtype == torch.int64
    assert torch.equal(ya[:, :-1], xa[:, 1:]) and bool((xa[:, 0] % 10 == 0).all())

    for _ in range(5):
        a.next_batch(8)
    state = a.state_dict()
    resumed = BatchSampler(tokens, 10, seed=1)
    resumed.load_state_dict(state)
    for _ in range(3):
        assert torch.equal(a.next_batch(8)[0], resumed.next_batch(8)[0])
    with pytest.raises(DataError, match="seed"):
        BatchSampler(tokens, 10, seed=3).load_state_dict(state)
    with pytest.raises(DataError, match="seq_len"):
        BatchSampler(tokens, 20, seed=1).load_state_dict(state)


def test_sampler_every_window_once_per_epoch() -> None:
    tokens = np.arange(1001, dtype=np.uint32)
    s = BatchSampler(tokens, 10, seed=0)
    assert s.n_windows == 100
    seen = np.concatenate([s.next_batch(4)[0][:, 0].numpy() // 10 for _ in range(25)])
    assert sorted(seen.tolist()) == list(range(100))
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["offset"] == 0
    # A batch that straddles epochs takes the end of one permutation and the start of the next.
    s.next_batch(96)
    straddle = s.sample_ids(8)
    assert len(set(straddle[:4].tolist())) == 4 and s.next_batch(8)[0].shape[0] == 8
    assert s.state_dict()["epoch"] == 2 and s.samples_seen == 2 * 100 + 4


@pytest.mark.parametrize("dp_size", [2, 4])
def test_dp_slices_concatenate_to_single_rank_batch(dp_size: int) -> None:
    tokens = np.arange(5001, dtype=np.uint16)
    single = BatchSampler(tokens, 16, seed=7)
    ranks = [BatchSampler(tokens, 16, seed=7) for _ in range(dp_size)]
    for _ in range(4):
        x, y = single.next_batch(8)
        parts = [r.next_batch(8, dp_rank=i, dp_size=dp_size) for i, r in enumerate(ranks)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
    assert all(r.state_dict() == single.state_dict() for r in ranks)


def test_sampler_position_is_layout_independent() -> None:
    tokens = np.arange(5001, dtype=np.uint16)
    single = BatchSampler(tokens, 16, seed=3)
    two = [BatchSampler(tokens, 16, seed=3) for _ in range(2)]
    for _ in range(3):
        single.next_batch(8)
        for i, r in enumerate(two):
            r.next_batch(8, dp_rank=i, dp_size=2)
    four = [BatchSampler(tokens, 16, seed=3) for _ in range(4)]
    for r in four:
        r.load_state_dict(two[0].state_dict())
    union = torch.cat([r.next_batch(8, dp_rank=i, dp_size=4)[0] for i, r in enumerate(four)])
    assert torch.equal(union, single.next_batch(8)[0])


def test_val_batches_fixed_and_dp_sliced() -> None:
    val = np.arange(3000, dtype=np.uint16)
    full = val_batches(val, 32, batch_size=4, n_batches=3)
    assert len(full) == 3 and all(x.shape == (4, 32) for x, _ in full)
    assert all(torch.equal(x, x2) for (x, _), (x2, _) in zip(full, val_batches(val, 32, 4, 3)))
    assert int(full[0][0][0, 0]) == 0 and int(full[-1][1][-1, -1]) == 2999  # spans the whole split
    halves = [val_batches(val, 32, 4, 3, dp_rank=r, dp_size=2) for r in range(2)]
    for b in range(3):
        assert torch.equal(torch.cat([halves[0][b][0], halves[1][b][0]]), full[b][0])
