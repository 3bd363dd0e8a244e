"""Hugging Face interop: import a transformers Llama folder, fine-tune it in any layout, export it back.

The checkpoints are made here with transformers (random init, `save_pretrained`): no downloads.
Figures the tests hold to:
- logits of transformers' `LlamaForCausalLM` and of isthmus on the imported weights: max abs
  difference <= 1e-4 in fp32, for multi-head and grouped-query attention;
- `model.init_from` training at dp 2 / tp 2 / pp 2: every step's loss and gradient norm within
  1e-5 relative of one process (the tolerance of tests/parallel/test_parallel_equivalence.py);
- HF -> isthmus -> HF is bit-exact, and an exported run loads in transformers with isthmus's logits.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from isthmus.errors import CheckpointError, ConfigError
from isthmus.models.llama import Transformer, build_model
from isthmus.models.pretrained import init_source_args
from isthmus.weights.export import ModelSource
from isthmus.weights.hf_export import write_hf_folder
from isthmus.weights.hf_names import from_hf_rows, hf_state_dict, to_hf_rows
from isthmus.weights.init_from import load_weights, open_weights
from multirank import run_ranks

transformers = pytest.importorskip("transformers")

SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 176}
VOCAB = 256  # isthmus's byte tokenizer
ATOL = 1e-4
RTOL = 1e-5  # tests/parallel/test_parallel_equivalence.py's, for losses and gradient norms
STEPS = 5


def save_hf(folder: Path, kv_heads: int, tied: bool = False, seed: int = 0, **save: Any) -> Any:
    """A random-init transformers Llama of the test shape, saved to ``folder``; returns the model."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        **SHAPE,
        num_key_value_heads=kv_heads,
        vocab_size=VOCAB,
        tie_word_embeddings=tied,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        initializer_range=0.1,  # logits of order 1, not 0.01: a layout error shows plainly
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, **save)
    return model


def isthmus_model(init_from: Path) -> Transformer:
    args = init_source_args(str(init_from))
    model = build_model(args, device="cpu")
    load_weights([model], open_weights(str(init_from), args))
    return model.eval()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logit_diff(hf: Any, ours: Transformer) -> float:
    x = tokens()
    return float((hf(x).logits - ours(x)).abs().max())


@pytest.fixture(scope="module")
def gqa(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("hf") / "gqa"
    return folder, save_hf(folder, kv_heads=2)


def test_rotary_permutation_round_trips() -> None:
    w = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    assert torch.equal(from_hf_rows(to_hf_rows(w, 2), 2), w)
    # Within a head of 4 rows, HF's halves (0, 1 | 2, 3) are isthmus's pairs (0, 2), (1, 3).
    assert to_hf_rows(w, 2)[:4, 0].tolist() == [0.0, 6.0, 3.0, 9.0]


def test_blocks_read_from_the_file_are_slices_of_the_whole(gqa: tuple[Path, Any]) -> None:
    args = init_source_args(str(gqa[0]))
    weights = open_weights(str(gqa[0]), args)
    for name in ("layers.1.attention.wq.weight", "layers.0.attention.wk.weight", "layers.0.feed_forward.w2.weight"):
        full = weights.tensor(name)
        # Rows that start and end inside a head (head_dim 16), and a column range.
        box = ((5, 3), (full.shape[0] - 12, 40))
        assert torch.equal(weights.block(name, box), full[5:-7, 3:43])
    assert torch.equal(weights.block("norm.weight", ((10,), (20,))), weights.tensor("norm.weight")[10:30])


@pytest.mark.parametrize(("kv_heads", "tied"), [(4, False), (2, False), (2, True)], ids=["mha", "gqa", "gqa_tied"])
def test_logits_match_transformers(tmp_path: Path, kv_heads: int, tied: bool) -> None:
    hf = save_hf(tmp_path, kv_heads, tied)
    ours = isthmus_model(tmp_path)
    assert ours.args.n_kv_heads == kv_heads and ours.args.tie_embeddings == tied
    assert ours.args.norm_eps == 1e-5 and ours.args.rope_theta == 500000.0
    assert logit_diff(hf, ours) <= ATOL


def test_sharded_bf16_folder_loads(tmp_path: Path, gqa: tuple[Path, Any]) -> None:
    copy.deepcopy(gqa[1]).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    # transformers' own fp32 reading of the bf16 weights (its rotary table stays fp32).
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert logit_diff(hf, isthmus_model(tmp_path)) <= ATOL


def _edit_config(src: Path, dst: Path, **changes: Any) -> Path:
    dst.mkdir()
    (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    config = {**json.loads((src / "config.json").read_text()), **changes}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_type": "mistral"}, "model_type"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters.rope_type"),
        ({"head_dim": 32}, "head_dim"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"vocab_size": 300}, "model.embed_tokens.weight"),
    ],
)
def test_unsupported_variants_refused_in_one_line(
    tmp_path: Path, gqa: tuple[Path, Any], change: dict[str, Any], field: str
) -> None:
    folder = _edit_config(gqa[0], tmp_path / "edited", **change)
    with pytest.raises(CheckpointError) as err:
        open_weights(str(folder), init_source_args(str(folder)))
    assert field in str(err.value) and "\n" not in str(err.value)


def test_shape_overrides_refused_with_init_from(gqa: tuple[Path, Any]) -> None:
    from isthmus.config import build_config, parse_overrides
    from isthmus.models.resolve import resolve_model_args

    cfg = build_config(None, parse_overrides(["--model.init_from", str(gqa[0]), "--model.dim", "128"]))
    with pytest.raises(ConfigError, match=r"^model\.dim = 128: is set by model\.init_from"):
        resolve_model_args(cfg.model, 256)
    cfg = build_config(None, parse_overrides(["--model.init_from", str(gqa[0])]))
    with pytest.raises(
        ConfigError, match=r"^model\.init_from = .*: its vocabulary \(256\) is smaller than the tokenizer's"
    ):
        resolve_model_args(cfg.model, 4096)


def test_hf_isthmus_hf_round_trip_is_bit_exact(tmp_path: Path, gqa: tuple[Path, Any]) -> None:
    from safetensors.torch import load_file

    folder = gqa[0]
    args = init_source_args(str(folder))
    weights = open_weights(str(folder), args)
    state = {name: weights.tensor(name) for name in build_model(args).state_dict()}
    write_hf_folder(ModelSource(state, args, {"train": {"seq_len": 64}}, "final", None), tmp_path / "out")
    original, back = load_file(folder / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)
    assert hf_state_dict(state, args).keys() == original.keys()


def test_hf_export_refusals(tmp_path: Path, gqa: tuple[Path, Any]) -> None:
    from dataclasses import replace

    from isthmus.errors import IsthmusError

    args = init_source_args(str(gqa[0]))
    state = build_model(args, device="cpu").state_dict()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").touch()
    with pytest.raises(IsthmusError, match="exists and is not an empty folder"):
        write_hf_folder(ModelSource(state, args, {}, "final", None), tmp_path / "full")
    with pytest.raises(IsthmusError, match=r"model\.mlp = 'gelu'"):
        write_hf_folder(ModelSource(state, replace(args, mlp="gelu"), {}, "final", None), tmp_path / "gelu")
    assert not (tmp_path / "gelu").exists()


# --- fine-tuning in every layout --------------------------------------------------------------------
BASE = [
    "--train.steps",
    str(STEPS),
    "--train.batch_size",
    "8",
    "--train.seq_len",
    "32",
    "--train.warmup_steps",
    "2",
    "--train.val_every",
    "0",
    "--train.val_batches",
    "1",
    "--data.max_bytes",
    "100000",
    "--metrics.progress",
    "false",
    "--train.threads",
    "1",
]


def _train(overrides: list[str], run_dir: str, cache_dir: str) -> tuple[list[float], list[float]]:
    import torch.distributed as dist

    from isthmus.config import build_config, parse_overrides
    from isthmus.launch.preflight import preflight
    from isthmus.log import setup_logging
    from isthmus.train.trainer import train

    args = [*BASE, *overrides, "--train.run_dir", run_dir, "--data.cache_dir", cache_dir]
    if dist.is_initialized():
        args += ["--parallel.nproc", str(dist.get_world_size())]
    cfg = build_config(None, parse_overrides(args))
    preflight(cfg)
    setup_logging(console=False)
    result = train(cfg)
    return result.losses, result.grad_norms


@pytest.fixture(scope="module")
def finetuned(gqa: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float], list[float]]:
    """One process fine-tuned from the GQA folder: (run dir, losses, gradient norms)."""
    root = tmp_path_factory.mktemp("finetune")
    losses, norms = _train(["--model.init_from", str(gqa[0])], str(root / "single"), str(root / "cache"))
    return root, losses, norms


def test_finetune_starts_from_the_checkpoint(gqa: tuple[Path, Any], finetuned: tuple[Path, list, list]) -> None:
    from isthmus.config import DataConfig
    from isthmus.data.corpus import prepare_data
    from isthmus.data.loader import BatchSampler

    root, losses, _ = finetuned
    assert json.loads((root / "single" / "final" / "model_args.json").read_text())["rope_theta"] == 500000.0
    # The first step's loss is transformers' loss of the checkpoint on the same batch.
    data = prepare_data(DataConfig(max_bytes=100000, cache_dir=str(root / "cache")), 32)
    inputs, targets = BatchSampler(data.train, 32, 0).next_batch(8)
    with torch.no_grad():
        logits = gqa[1](torch.as_tensor(inputs)).logits
    hf_loss = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.as_tensor(targets).flatten()))
    assert losses[0] == pytest.approx(hf_loss, rel=RTOL)
    assert losses[-1] < losses[0]


LAYOUTS: list[tuple[str, int, list[str]]] = [
    ("dp2", 2, ["--parallel.dp_shard", "2"]),
    ("tp2", 2, ["--parallel.tp", "2"]),
    ("pp2", 2, ["--parallel.pp", "2", "--parallel.microbatches", "2"]),
    # FSDP over TP splits wq's rows twice (a _StridedShard): each rank still reads one block of the file.
    ("dp2_tp2", 4, ["--parallel.dp_shard", "2", "--parallel.tp", "2"]),
]


@pytest.mark.parametrize(("name", "world", "layout"), LAYOUTS, ids=[c[0] for c in LAYOUTS])
@pytest.mark.slow
def test_finetune_layouts_match_one_process(
    gqa: tuple[Path, Any], finetuned: tuple[Path, list, list], name: str, world: int, layout: list[str]
) -> None:
    root, ref_losses, ref_norms = finetuned
    init = ["--model.init_from", str(gqa[0])]
    per_rank = run_ranks(_train, world, [*init, *layout], str(root / name), str(root / "cache"))
    losses, norms = per_rank[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=RTOL, atol=0)


def test_exported_run_loads_in_transformers(finetuned: tuple[Path, list, list], tmp_path: Path) -> None:
    from isthmus.cli import main

    run = finetuned[0] / "single"
    assert main(["export", "--run", str(run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = isthmus_model(tmp_path / "hf")
    assert logit_diff(hf, ours) <= ATOL
    # The same weights as the run's final model, and the folder trains on again (model.init_from).
    final = torch.load(run / "final" / "model.pt", weights_only=True)
    assert all(torch.equal(p, final[n]) for n, p in ours.state_dict().items())


def test_isthmus_export_file_is_an_init_source(finetuned: tuple[Path, list, list], tmp_path: Path) -> None:
    from isthmus.cli import main

    run = finetuned[0] / "single"
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "model.safetensors")]) == 0
    ours = isthmus_model(tmp_path / "model.safetensors")
    final = torch.load(run / "final" / "model.pt", weights_only=True)
    assert all(torch.equal(p, final[n]) for n, p in ours.state_dict().items())


def test_gelu_isthmus_export_is_an_init_source(tmp_path: Path) -> None:
    from dataclasses import replace

    from isthmus.models.flavors import get_flavor
    from isthmus.models.llama import init_weights
    from isthmus.weights.export import export_model

    args = replace(get_flavor("tiny"), mlp="gelu", tie_embeddings=True)
    model = build_model(args, device="cpu")
    init_weights(model, 3, args)
    source = ModelSource(model.state_dict(), args, {}, "final", None)
    export_model(source, {"kind": "byte", "vocab_size": 256}, tmp_path / "gelu.safetensors")
    loaded = isthmus_model(tmp_path / "gelu.safetensors")
    assert loaded.args == args
    assert all(torch.equal(p, model.state_dict()[n]) for n, p in loaded.state_dict().items())
