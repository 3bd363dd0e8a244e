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
from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from isthmus.cli import main
from isthmus.config import DataConfig
from isthmus.data.corpus import prepare_data
from isthmus.data.loader import BatchSampler
from isthmus.data.tokenizer import PretrainedTokenizer
from isthmus.models.llama import KVCache, Transformer, build_model
from isthmus.models.pretrained import init_source_args
from isthmus.serve.generate import generate_ids
from isthmus.weights.export import load_exported
from isthmus.weights.init_from import load_weights, open_weights

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
    # As Llama's tokenizer.json: BOS added by the post-processor (isthmus adds it itself, once).
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
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
    # What the loader yields: windows of that stream (each starts where its index says).
    inputs, targets = BatchSampler(data.train, SEQ_LEN, 0).next_batch(4)
    for row, target in zip(inputs.tolist(), targets.tolist(), strict=True):
        start = next(i for i in range(len(stream)) if stream[i : i + SEQ_LEN + 1] == [*row, target[-1]])
        assert stream[start + 1 : start + SEQ_LEN + 1] == target
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


def test_bin_ids_outside_the_tokenizer_refused_before_work(
    corpus: tuple[Path, Tokenizer, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, _, _ = corpus
    np.arange(5000, 5100, dtype=np.uint16).tofile(tmp_path / "ids.bin")
    args = ["train", "--data.path", str(tmp_path / "ids.bin"), "--data.tokenizer", f"hf:{root / 'tok'}"]
    assert main([*args, "--train.run_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "largest id 5,099 is outside data.tokenizer's vocabulary" in err[0], err
    assert not (tmp_path / "run").exists()


def test_slow_tokenizer_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "tokenizer.model").write_bytes(b"\0")
    args = ["tokenize", "--data.tokenizer", f"hf:{tmp_path / 'slow'}", "--out", str(tmp_path / "x.bin")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokenizer.model is a slow tokenizer" in err[0]


def train_args(root: Path, run: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--config",
        "tiny",
        "--train.steps",
        "2",
        "--train.seq_len",
        str(SEQ_LEN),
        "--train.val_every",
        "0",
        "--metrics.progress",
        "false",
        "--data.path",
        str(root / "corpus"),
        "--data.cache_dir",
        str(root / "cache"),
        "--train.run_dir",
        str(run),
        *extra,
    ]


def test_train_and_export_with_the_checkpoint_tokenizer(
    corpus: tuple[Path, Tokenizer, list[str]], tmp_path: Path
) -> None:
    root, tok, _ = corpus
    spec = f"hf:{root / 'tok'}"
    assert main(train_args(root, tmp_path / "run", "--data.tokenizer", spec)) == 0
    assert (
        json.loads((tmp_path / "run" / "final" / "model_args.json").read_text())["vocab_size"] == tok.get_vocab_size()
    )
    assert main(["export", "--run", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = PretrainedTokenizer.from_spec(spec)
    for text in TEXTS:
        assert loaded(text).input_ids == ours.encode(text)
        assert loaded.decode(ours.encode(text), skip_special_tokens=True) == text
    # isthmus's own export carries the tokenizer (and its BOS/EOS) too.
    assert main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "m.safetensors")]) == 0
    exported = load_exported(tmp_path / "m.safetensors").tokenizer
    assert isinstance(exported, PretrainedTokenizer) and exported.encode_document(TEXTS[0]) == ours.encode_document(
        TEXTS[0]
    )


def test_byte_export_writes_a_byte_tokenizer(
    corpus: tuple[Path, Tokenizer, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, _, _ = corpus
    assert main(train_args(root, tmp_path / "run")) == 0
    capsys.readouterr()
    assert main(["export", "--run", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert "byte-level BPE without merges" in capsys.readouterr().out
    text = "héllo wörld\n\t日本"
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")(text).input_ids == list(text.encode())
    # And isthmus generate reads the folder with it, as the run itself.
    args = ["--prompt", "def ", "--max-new-tokens", "5", "--temperature", "0"]
    assert main(["generate", "--model", str(tmp_path / "hf"), *args]) == 0
    from_folder = capsys.readouterr().out
    assert main(["generate", "--run", str(tmp_path / "run"), *args]) == 0
    assert from_folder == capsys.readouterr().out


def test_tokenizer_larger_than_the_checkpoint_refused(
    corpus: tuple[Path, Tokenizer, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, tok, _ = corpus
    small = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=256
    )
    transformers.LlamaForCausalLM(small).save_pretrained(tmp_path / "small")
    capsys.readouterr()
    args = train_args(
        root, tmp_path / "run", "--data.tokenizer", f"hf:{root / 'tok'}", "--model.init_from", str(tmp_path / "small")
    )
    assert main([a for a in args if a not in ("--config", "tiny")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"smaller than the tokenizer's ({tok.get_vocab_size()})" in err[0], err
    assert not (tmp_path / "run").exists()


TRAINED = 32  # max_position_embeddings of the checkpoints below: generation runs to twice it
KV_ATOL = 1e-5


def save_llama(folder: Path, kv_heads: int, vocab: int = 300, seed: int = 0) -> Any:
    """A random transformers Llama (logits of order 1), saved to ``folder``; returns it in eval mode."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        intermediate_size=128,
        vocab_size=vocab,
        max_position_embeddings=TRAINED,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def isthmus_model(folder: Path) -> Transformer:
    args = init_source_args(str(folder))
    model = build_model(args, device="cpu")
    load_weights([model], open_weights(str(folder), args))
    return model.eval()


@torch.no_grad()
def test_kv_cache_logits_equal_full_recompute(tmp_path: Path) -> None:
    save_llama(tmp_path / "m", kv_heads=2)
    model = isthmus_model(tmp_path / "m")
    x = torch.randint(0, 300, (2, 2 * TRAINED), generator=torch.Generator().manual_seed(3))
    full = model(x)
    cache = KVCache()
    # A prompt of several tokens (the masked path), then one token at a time.
    parts = [model(x[:, :10], cache=cache)] + [model(x[:, i : i + 1], cache=cache) for i in range(10, x.shape[1])]
    assert cache.length == x.shape[1]
    assert float((torch.cat(parts, dim=1) - full).abs().max()) <= KV_ATOL


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@torch.no_grad()
def test_greedy_generation_equals_transformers(tmp_path: Path, kv_heads: int) -> None:
    hf = save_llama(tmp_path / "m", kv_heads)
    hf.generation_config.eos_token_id = None  # run the whole length: no early stop on either side
    prompt = torch.randint(2, 300, (1, 8), generator=torch.Generator().manual_seed(kv_heads))
    new = 2 * TRAINED - prompt.shape[1]
    theirs = hf.generate(prompt, do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)[0]
    ours = generate_ids(isthmus_model(tmp_path / "m"), prompt[0].tolist(), new)
    assert len(ours) == 2 * TRAINED
    assert ours == theirs.tolist()


def test_generate_cli_reads_an_hf_folder(
    corpus: tuple[Path, Tokenizer, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, tok, _ = corpus
    hf = save_llama(tmp_path / "m", kv_heads=2, vocab=tok.get_vocab_size())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "m" / name).write_bytes((root / "tok" / name).read_bytes())
    new = 2 * TRAINED
    args = ["generate", "--model", str(tmp_path / "m"), "--prompt", "def ", "--temperature", "0"]
    assert main([*args, "--max-new-tokens", str(new)]) == 0
    ids = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")("def ", return_tensors="pt").input_ids
    with torch.no_grad():
        # attention_mask given: left alone, transformers would mask the BOS (id 0, the pad id here).
        mask = torch.ones_like(ids)
        theirs = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, pad_token_id=0)[0]
    assert capsys.readouterr().out == tok.decode(theirs.tolist(), skip_special_tokens=True) + "\n"
    (tmp_path / "m" / "tokenizer.json").unlink()
    assert main([*args, "--max-new-tokens", "1"]) == 2
    assert "without tokenizer.json" in capsys.readouterr().err
