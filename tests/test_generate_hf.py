"""A checkpoint's tokenizer (``data.tokenizer = "hf:PATH"``), its export, and generation that never restarts positions.

The tokenizer is a tiny byte-level BPE trained here with ``tokenizers`` and the checkpoints random
transformers Llamas saved here: no downloads. Figures the tests hold to:
- the tokens the loader yields are the tokenizer's encoding, each document BOS + text + EOS;
- the .bin `isthmus tokenize` writes reads back as those same tokens;
- an exported run's folder loads in transformers' AutoTokenizer, which encodes as the run did;
- logits of one step with the KV cache equal a full recompute within 1e-5 (fp32);
- greedy generation equals transformers' ``generate(do_sample=False)`` token for token over twice
  the trained sequence length, for multi-head and grouped-query attention.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from isthmus.cli import main
from isthmus.config import DataConfig
from isthmus.data.corpus import prepare_data
from isthmus.data.tokenizer import PretrainedTokenizer

transformers = pytest.importorskip("transformers")

TEXTS = ["def add(x, y):\n    return x + y\n", "class Point:\n    x: int = 0\n", "import os\nprint(os.sep)\n"]
BOS, EOS = "<s>", "</s>"
SEQ_LEN = 16


def save_tokenizer(folder: Path) -> Tokenizer:
    """A byte-level BPE with BOS/EOS, trained on TEXTS, saved as an HF tokenizer folder would hold it."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[BOS, EOS],
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS * 10, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    return tok


def write_corpus(folder: Path) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    docs = [TEXTS[i % 3] * (1 + i % 4) for i in range(12)]
    for i, doc in enumerate(docs):
        (folder / f"doc{i:02}.py").write_text(doc)
    return docs


def encoded(tok: Tokenizer, docs: list[str]) -> list[int]:
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    return [i for doc in docs for i in [bos, *tok.encode(doc, add_special_tokens=False).ids, eos]]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Tokenizer, list[str]]:
    root = tmp_path_factory.mktemp("hftok")
    tok = save_tokenizer(root / "tok")
    return root, tok, write_corpus(root / "corpus")


def test_documents_are_bos_text_eos(corpus: tuple[Path, Tokenizer, list[str]]) -> None:
    root, tok, docs = corpus
    cfg = DataConfig(path=str(root / "corpus"), tokenizer=f"hf:{root / 'tok'}", cache_dir=str(root / "cache"))
    data = prepare_data(cfg, SEQ_LEN)
    assert isinstance(data.tokenizer, PretrainedTokenizer)
    assert (data.tokenizer.bos_id, data.tokenizer.eos_id) == (0, 1)
    stream = np.concatenate([data.train, data.val]).tolist()
    assert stream == encoded(tok, docs)
    # The file itself names the tokenizer just as well as its folder.
    assert PretrainedTokenizer.from_spec(f"hf:{root / 'tok' / 'tokenizer.json'}").vocab_size == tok.get_vocab_size()


def test_tokenize_command_bin_reads_back(corpus: tuple[Path, Tokenizer, list[str]], tmp_path: Path) -> None:
    root, tok, docs = corpus
    out = tmp_path / "corpus.bin"
    spec = f"hf:{root / 'tok'}"
    assert main(["tokenize", "--data.path", str(root / "corpus"), "--data.tokenizer", spec, "--out", str(out)]) == 0
    assert np.fromfile(out, dtype=np.uint16).tolist() == encoded(tok, docs)
    data = prepare_data(DataConfig(path=str(out), tokenizer=spec), SEQ_LEN)
    assert isinstance(data.tokenizer, PretrainedTokenizer)
    assert np.concatenate([data.train, data.val]).tolist() == encoded(tok, docs)


def test_slow_tokenizer_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "tokenizer.model").write_bytes(b"\0")
    args = ["tokenize", "--data.tokenizer", f"hf:{tmp_path / 'slow'}", "--out", str(tmp_path / "x.bin")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokenizer.model is a slow tokenizer" in err[0]
