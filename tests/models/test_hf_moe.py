"""Hugging Face interop for Mixtral, Qwen3-MoE and Qwen3: import, fine-tune, export back.

The checkpoints are made here with transformers (random init, `save_pretrained`): no downloads.
Figures the tests hold to:
- logits of transformers' model and of isthmus on the imported weights: max abs difference <= 1e-4
  in fp32 (Mixtral; Qwen3-MoE with a head width that is not hidden / heads, with and without
  renormalised top-k weights and a dense first block; dense Qwen3);
- HF -> isthmus -> HF is bit-exact, experts split back one tensor each;
- a run started from the folder begins at transformers' loss on the same batch, and its export loads
  in transformers with isthmus's logits;
- fine-tuning at ep 2 (also over dp_shard 4), dp 2 and, for Qwen3's q/k norms, tp 2: every step's
  loss within 1e-5 relative of one process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from isthmus.errors import CheckpointError
from isthmus.models.args import ModelArgs
from isthmus.models.llama import Transformer, build_model
from isthmus.models.pretrained import init_source_args
from isthmus.weights.export import ModelSource
from isthmus.weights.hf_export import write_hf_folder
from isthmus.weights.init_from import load_weights, open_weights

transformers = pytest.importorskip("transformers")

SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
MOE = {"num_experts_per_tok": 2, "router_aux_loss_coef": 0.02}
VOCAB = 256  # isthmus's byte tokenizer
ATOL = 1e-4
RTOL = 1e-5

# name -> (config class, model class, config fields)
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**MOE, "num_local_experts": 4, "intermediate_size": 96}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        # head_dim 32: queries 128 wide at hidden 64, as Qwen3-30B-A3B's (128 x 32 heads at 2048).
        {**MOE, "num_experts": 4, "moe_intermediate_size": 48, "intermediate_size": 96, "head_dim": 32}
        | {"norm_topk_prob": True},
    ),
    "qwen3_moe_dense0": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {**MOE, "num_experts": 4, "moe_intermediate_size": 48, "intermediate_size": 96, "head_dim": 16}
        | {"norm_topk_prob": False, "mlp_only_layers": [0]},
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {"intermediate_size": 96, "head_dim": 32, "tie_word_embeddings": True},
    ),
}


def save_hf(folder: Path, name: str, seed: int = 0) -> Any:
    """A random-init transformers model ``name`` of the test shape, saved to ``folder``; returns it."""
    config_cls, model_cls, fields = MODELS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(
        **SHAPE,
        **fields,
        vocab_size=VOCAB,
        rms_norm_eps=1e-5,
        initializer_range=0.1,  # logits of order 1, not 0.01: a layout error shows plainly
    )
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):  # not all ones: a q/k norm scale in the wrong order shows too
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return model


def isthmus_model(init_from: Path) -> Transformer:
    args = init_source_args(str(init_from))
    model = build_model(args, device="cpu")
    load_weights([model], open_weights(str(init_from), args))
    return model.eval()


@torch.no_grad()
def logit_diff(hf: Any, ours: Transformer) -> float:
    x = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    return float((hf(x).logits - ours(x)).abs().max())


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("hf_moe")
    return {name: (root / name, save_hf(root / name, name)) for name in MODELS}


def test_config_json_becomes_model_args(folders: dict[str, tuple[Path, Any]]) -> None:
    mixtral = init_source_args(str(folders["mixtral"][0]))
    assert (mixtral.n_experts, mixtral.top_k, mixtral.expert_ffn_dim, mixtral.n_dense_layers) == (4, 2, 96, 0)
    assert mixtral.router_norm_topk and not mixtral.qk_norm and mixtral.head_dim == 16
    assert mixtral.aux_loss_coef == 0.02 and mixtral.rope_theta == 1e6
    qwen = init_source_args(str(folders["qwen3_moe"][0]))
    assert (qwen.n_experts, qwen.expert_ffn_dim, qwen.ffn_dim, qwen.head_dim) == (4, 48, 96, 32)
    assert qwen.qk_norm and qwen.router_norm_topk
    dense0 = init_source_args(str(folders["qwen3_moe_dense0"][0]))
    assert dense0.n_dense_layers == 1 and not dense0.router_norm_topk and dense0.attn_head_dim == 0
    qwen3 = init_source_args(str(folders["qwen3"][0]))
    assert not qwen3.is_moe and qwen3.qk_norm and qwen3.tie_embeddings


@pytest.mark.parametrize("name", list(MODELS))
def test_parameter_counts_are_exact(folders: dict[str, tuple[Path, Any]], name: str) -> None:
    from isthmus.models.flops import count_params

    args = init_source_args(str(folders[name][0]))
    expert_biases = args.n_moe_layers * args.n_experts  # isthmus's, which HF lacks
    assert count_params(args) == sum(p.numel() for p in build_model(args).parameters())
    assert count_params(args) == folders[name][1].num_parameters() + expert_biases


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_transformers(folders: dict[str, tuple[Path, Any]], name: str) -> None:
    folder, hf = folders[name]
    assert logit_diff(hf, isthmus_model(folder)) <= ATOL


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
@torch.no_grad()
def test_cached_decoding_matches_transformers(folders: dict[str, tuple[Path, Any]], name: str) -> None:
    """`isthmus generate`'s path: a prompt, then one token at a time through the KV cache."""
    from isthmus.models.llama import KVCache

    folder, hf = folders[name]
    ours, cache = isthmus_model(folder), KVCache()
    x = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    steps = [ours(x[:, :16], cache=cache)] + [ours(x[:, i : i + 1], cache=cache) for i in range(16, 24)]
    assert float((torch.cat(steps, dim=1) - hf(x).logits).abs().max()) <= ATOL


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_isthmus_hf_round_trip_is_bit_exact(tmp_path: Path, folders: dict[str, tuple[Path, Any]], name: str) -> None:
    from safetensors.torch import load_file

    folder = folders[name][0]
    args = init_source_args(str(folder))
    weights = open_weights(str(folder), args)
    tied = {"output.weight"} if args.tie_embeddings else set()  # the embedding, read under its own name
    state = {n: weights.tensor(n) for n in build_model(args).state_dict() if n not in tied}
    write_hf_folder(ModelSource(state, args, {"train": {"seq_len": 64}}, "final", None), tmp_path / "out")
    original, back = load_file(folder / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)
    assert init_source_args(str(tmp_path / "out")) == args


def test_sharded_bf16_folder_loads(tmp_path: Path, folders: dict[str, tuple[Path, Any]]) -> None:
    """Experts spread over several files of a safetensors index, in bf16."""
    import copy

    copy.deepcopy(folders["qwen3_moe"][1]).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len({f for n, f in index.items() if ".experts." in n}) > 1
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert logit_diff(hf, isthmus_model(tmp_path)) <= ATOL


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_fused_experts_load(tmp_path: Path, folders: dict[str, tuple[Path, Any]], name: str) -> None:
    """A file under transformers 5's in-memory names: experts.gate_up_proj [E, 2F, D] and down_proj."""
    from safetensors.torch import save_file

    folder, hf = folders[name]
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    (tmp_path / "fused").mkdir()
    save_file(state, str(tmp_path / "fused" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "fused" / "config.json").write_text((folder / "config.json").read_text())
    ours, args = isthmus_model(tmp_path / "fused"), init_source_args(str(folder))
    assert logit_diff(hf, ours) <= ATOL
    weights = open_weights(str(tmp_path / "fused"), args)
    box = ((1, 8, 4), (2, 20, 30))  # some experts, rows in the up half's range, some columns
    assert torch.equal(
        weights.block("layers.1.feed_forward.experts.w3", box),
        isthmus_model(folder).state_dict()["layers.1.feed_forward.experts.w3"][1:3, 8:28, 4:34],
    )


def test_expert_blocks_are_slices_of_the_stack(folders: dict[str, tuple[Path, Any]]) -> None:
    """What an expert-parallel or FSDP shard reads: some experts, some rows, from per-expert tensors."""
    args = init_source_args(str(folders["qwen3_moe"][0]))
    weights = open_weights(str(folders["qwen3_moe"][0]), args)
    full = weights.tensor("layers.1.feed_forward.experts.w2")
    assert full.shape == (4, 64, 48)
    assert torch.equal(weights.block("layers.1.feed_forward.experts.w2", ((1, 8, 0), (2, 20, 48))), full[1:3, 8:28])
    assert weights.block("layers.1.feed_forward.experts.w2", ((4, 0, 0), (0, 64, 48))).shape == (0, 64, 48)
    assert torch.equal(weights.tensor("layers.1.feed_forward.router.expert_bias"), torch.zeros(4))
    # A q norm scale is in isthmus's rotary order: each head's pairs interleaved.
    q_norm = weights.tensor("layers.0.attention.q_norm.weight")
    hf = folders["qwen3_moe"][1].model.layers[0].self_attn.q_norm.weight.detach()
    assert torch.equal(q_norm[0::2], hf[:16]) and torch.equal(q_norm[1::2], hf[16:])


def _edit_config(src: Path, dst: Path, **changes: Any) -> Path:
    dst.mkdir()
    (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    config = {**json.loads((src / "config.json").read_text()), **changes}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("name", "change", "field"),
    [
        ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
        ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window"),
        ("qwen3_moe", {"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ("qwen3_moe", {"moe_intermediate_size": 64}, "moe_intermediate_size"),
        ("qwen3_moe", {"head_dim": 16}, "head_dim"),
        ("qwen3_moe", {"num_experts": 0}, "num_experts"),
        ("qwen3_moe", {"num_experts_per_tok": "2"}, "num_experts_per_tok"),
        ("qwen3_moe", {"router_aux_loss_coef": -1}, "router_aux_loss_coef"),
        ("qwen3_moe", {"norm_topk_prob": "yes"}, "norm_topk_prob"),
        ("qwen3_moe", {"mlp_only_layers": "0"}, "mlp_only_layers"),
        ("qwen3", {"attention_bias": True}, "attention_bias"),
        ("mixtral", {"sliding_window": 4096}, "sliding_window"),
        ("mixtral", {"num_local_experts": 8}, "num_local_experts"),
        ("mixtral", {"architectures": ["MixtralForSequenceClassification"]}, "architectures"),
        ("mixtral", {"model_type": "qwen2_moe"}, "model_type"),
    ],
)
def test_unsupported_variants_refused_in_one_line(
    tmp_path: Path, folders: dict[str, tuple[Path, Any]], name: str, change: dict[str, Any], field: str
) -> None:
    folder = _edit_config(folders[name][0], tmp_path / "edited", **change)
    with pytest.raises(CheckpointError) as err:
        open_weights(str(folder), init_source_args(str(folder)))
    assert field in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("change", "architecture"),
    [
        ({}, "MixtralForCausalLM"),
        ({"qk_norm": True, "n_dense_layers": 1, "router_norm_topk": False, "attn_head_dim": 32}, "Qwen3MoeForCausalLM"),
    ],
    ids=["mixtral", "qwen3_moe"],
)
def test_a_model_isthmus_trained_exports_to_transformers(
    tmp_path: Path, change: dict[str, Any], architecture: str
) -> None:
    """From isthmus's own init (the moe-tiny flavor, its norm scales moved off 1) to transformers' logits."""
    from dataclasses import replace

    from isthmus.models.flavors import get_flavor
    from isthmus.models.llama import init_weights

    args = replace(get_flavor("moe-tiny"), **change)
    model = build_model(args, device="cpu")
    init_weights(model, 5, args)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(n)))
    write_hf_folder(ModelSource(model.state_dict(), args, {}, "final", None), tmp_path / "hf")
    hf = getattr(transformers, architecture).from_pretrained(tmp_path / "hf").eval()
    assert logit_diff(hf, model.eval()) <= ATOL
    if architecture == "MixtralForCausalLM":  # one width, intermediate_size: the experts'
        args = replace(args, ffn_dim=args.expert_ffn_dim, moe_ffn_dim=0)
    assert init_source_args(str(tmp_path / "hf")) == args


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        ({"n_shared_experts": 1}, "model.n_shared_experts = 1: Mixtral and Qwen3-MoE have no shared experts"),
        ({"router_score": "sigmoid"}, "model.router_score = 'sigmoid': "),
        ({"load_balance": "bias"}, "model.load_balance = 'bias': "),
        ({"n_dense_layers": 1}, "model.n_dense_layers = 1: every Mixtral block is MoE"),
    ],
)
def test_hf_export_refuses_what_mixtral_and_qwen3_moe_lack(tmp_path: Path, change: dict[str, Any], rule: str) -> None:
    from dataclasses import replace

    from isthmus.errors import IsthmusError

    args = replace(ModelArgs(64, 2, 4, 2, 96, VOCAB, n_experts=4, moe_ffn_dim=48), **change)
    state = build_model(args, device="cpu").state_dict()
    with pytest.raises(IsthmusError) as err:
        write_hf_folder(ModelSource(state, args, {}, "final", None), tmp_path / "out")
    assert str(err.value).startswith(rule) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


# --- fine-tuning, then export ----------------------------------------------------------------------
BASE = [
    "--train.steps",
    "3",
    "--train.batch_size",
    "4",
    "--train.seq_len",
    "32",
    "--train.warmup_steps",
    "1",
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
    # The loss is the cross-entropy alone, so its first value is transformers' on the same batch.
    "--model.load_balance",
    "none",
]


def _train(overrides: list[str], run_dir: str, cache_dir: str) -> list[float]:
    from isthmus.config import build_config, parse_overrides
    from isthmus.launch.preflight import preflight
    from isthmus.log import setup_logging
    from isthmus.train.trainer import train

    cfg = build_config(
        None, parse_overrides([*BASE, *overrides, "--train.run_dir", run_dir, "--data.cache_dir", cache_dir])
    )
    preflight(cfg)
    setup_logging(console=False)
    return train(cfg).losses


def _hf_loss(hf: Any, cache: Path) -> float:
    from isthmus.config import DataConfig
    from isthmus.data.corpus import prepare_data
    from isthmus.data.loader import BatchSampler

    data = prepare_data(DataConfig(max_bytes=100000, cache_dir=str(cache)), 32)
    inputs, targets = BatchSampler(data.train, 32, 0).next_batch(4)
    with torch.no_grad():
        logits = hf(torch.as_tensor(inputs)).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.as_tensor(targets).flatten()))


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_finetune_then_export_loads_in_transformers(
    tmp_path: Path, folders: dict[str, tuple[Path, Any]], name: str
) -> None:
    from isthmus.cli import main

    folder, hf = folders[name]
    run = tmp_path / "run"
    losses = _train(["--model.init_from", str(folder)], str(run), str(tmp_path / "cache"))
    assert losses[0] == pytest.approx(_hf_loss(hf, tmp_path / "cache"), rel=RTOL)
    assert losses[-1] < losses[0]
    assert main(["export", "--run", str(run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [MODELS[name][1]]
    exported = getattr(transformers, MODELS[name][1]).from_pretrained(tmp_path / "hf").eval()
    ours = isthmus_model(tmp_path / "hf")
    assert logit_diff(exported, ours) <= ATOL
    # The same weights as the run's final model (the export adds nothing, drops only the zero biases).
    final = torch.load(run / "final" / "model.pt", weights_only=True)
    assert all(torch.equal(p, final[n]) for n, p in ours.state_dict().items())


LAYOUTS = [
    pytest.param("qwen3_moe", 2, ["--parallel.dp_shard", "2"], id="qwen3_moe_dp2", marks=pytest.mark.slow),
    # Each rank reads only its own experts' blocks from the per-expert tensors.
    pytest.param("mixtral", 2, ["--parallel.ep", "2"], id="mixtral_ep2"),
    # FSDP over the experts EP holds: a _StridedShard, still one block per rank.
    pytest.param("mixtral", 4, ["--parallel.ep", "2", "--parallel.dp_shard", "4"], id="mixtral_ep2_dp4"),
    # Each rank's heads see the shared q/k norm scales: their gradients are summed over the group.
    pytest.param("qwen3", 2, ["--parallel.tp", "2"], id="qwen3_tp2"),
    # Experts split by hidden unit under tensor parallel, and both at once.
    pytest.param("qwen3_moe", 2, ["--parallel.tp", "2"], id="qwen3_moe_tp2"),
    pytest.param("qwen3_moe", 4, ["--parallel.ep", "2", "--parallel.tp", "2"], id="qwen3_moe_ep2_tp2"),
    # A stage reads only its own blocks: the dense first one, or the MoE one.
    pytest.param(
        "qwen3_moe_dense0", 2, ["--parallel.pp", "2", "--parallel.microbatches", "2"], id="qwen3_moe_dense0_pp2"
    ),
]


@pytest.mark.parametrize(("name", "world", "layout"), LAYOUTS)
def test_finetune_layouts_match_one_process(
    tmp_path: Path, folders: dict[str, tuple[Path, Any]], name: str, world: int, layout: list[str]
) -> None:
    from multirank import run_ranks

    init = ["--model.init_from", str(folders[name][0])]
    ref = _train(init, str(tmp_path / "one"), str(tmp_path / "cache"))
    per_rank = run_ranks(_train_ranks, world, [*init, *layout], str(tmp_path / "layout"), str(tmp_path / "cache"))
    torch.testing.assert_close(torch.tensor(per_rank[0]), torch.tensor(ref), rtol=RTOL, atol=0)


def _train_ranks(overrides: list[str], run_dir: str, cache_dir: str) -> list[float]:
    import torch.distributed as dist

    return _train([*overrides, "--parallel.nproc", str(dist.get_world_size())], run_dir, cache_dir)


def _boxes_match_dtensor_slices() -> list[bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from isthmus.weights.init_from import _local_box

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "ep"))
    full = torch.arange(8 * 6 * 3, dtype=torch.float32).view(8, 6, 3)
    results = []
    # FSDP over EP (or TP) on the same dimension, FSDP on another one, and an uneven strided split.
    for placements, rows in (((_StridedShard(0, split_factor=2), Shard(0)), 8), ((Shard(1), Shard(0)), 8)):
        local = distribute_tensor(full[:rows], mesh, placements, src_data_rank=None)
        box = _local_box(local)
        assert box is not None
        index = tuple(slice(o, o + n) for o, n in zip(*box, strict=True))
        results.append(torch.equal(full[:rows][index], local.to_local()))
    uneven = distribute_tensor(full[:6], mesh, (_StridedShard(0, split_factor=2), Shard(0)), src_data_rank=None)
    results.append(_local_box(uneven) is None)
    return results


def test_a_rank_reads_its_block_when_fsdp_shards_a_sharded_dimension() -> None:
    from multirank import run_ranks

    assert all(all(rank) for rank in run_ranks(_boxes_match_dtensor_slices, 4))
