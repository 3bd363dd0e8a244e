"""Every parallel layout trains exactly like one process of the same seed.

Each case runs the real trainer on real gloo ranks (`multirank.run_ranks`) for 5 optimizer steps
of the `tiny` flavor in fp32 and compares every step's loss and the final parameters against the
single-process run. Tolerances, the same for every case:
- every step's loss and global gradient norm: 1e-5 relative. The gradient norm is what catches a
  gradient-scaling bug (summed instead of averaged), which AdamW's scale invariance would hide
  from the parameters;
- final parameters: 5e-5 relative in norm per tensor (||a - b|| / ||b||), not 1e-5. That is the
  floor of fp32 AdamW itself, not of parallelism: it divides by sqrt(v), so elements whose
  gradient is near zero amplify a last-bit difference in a sum. Measured here, the single-process
  run differs from itself by up to 1.3e-5 when only its summation order changes (the same batch
  as 4 accumulated micro-batches); a real sharding or averaging error shows as 1e-3 and more.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from multirank import run_ranks

BASE = [
    "--model.flavor",
    "tiny",
    "--train.steps",
    "5",
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
RTOL = 1e-5
PARAM_RTOL = 5e-5


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


@functools.cache
def _reference(
    root: str, model: tuple[str, ...] = ()
) -> tuple[tuple[list[float], list[float]], dict[str, torch.Tensor]]:
    """The single-process run (of the model ``model``'s flags describe) every layout is held to."""
    run = Path(root) / "-".join(("single", *(m.strip("-") for m in model)))
    curves = _train(list(model), str(run), str(Path(root) / "cache"))
    return curves, torch.load(run / "final" / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("equivalence")


def _check(
    workdir: Path, name: str, world: int, overrides: list[str], model: tuple[str, ...] = ()
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``name``'s layout on ``world`` ranks and compare it with the single process of the same
    model; returns its losses and final parameters for the caller's own checks."""
    (ref_losses, ref_norms), ref_params = _reference(str(workdir), model)
    run = workdir / name
    per_rank = run_ranks(_train, world, [*model, *overrides], str(run), str(workdir / "cache"))
    losses, norms = per_rank[0]
    assert all(r == per_rank[0] for r in per_rank), "ranks disagree on the logged loss or gradient norm"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=RTOL, atol=0)
    params = torch.load(run / "final" / "model.pt", weights_only=True)
    assert params.keys() == ref_params.keys()
    for key, ref in ref_params.items():
        if ref.norm() == 0:  # a parameter that stays zero (a MoE router's expert_bias without the bias method)
            assert params[key].norm() == 0, key
            continue
        rel = float((params[key] - ref).norm() / ref.norm())
        assert rel < PARAM_RTOL, f"{name}: {key} differs by {rel:.2e} (relative norm)"
    return losses, params
    assert losses[-1] < losses[0]  # it really trained


CASES: list[tuple[str, int, list[str]]] = [
    ("dp_replicate2", 2, ["--parallel.dp_replicate", "2"]),
    ("dp_replicate2_accum2", 2, ["--parallel.dp_replicate", "2", "--train.grad_accum", "2"]),
    ("dp_shard2_zero1", 2, ["--parallel.dp_shard", "2", "--parallel.zero_stage", "1"]),
    ("dp_shard2_zero2", 2, ["--parallel.dp_shard", "2", "--parallel.zero_stage", "2"]),
    ("dp_shard2_zero3", 2, ["--parallel.dp_shard", "2", "--parallel.zero_stage", "3"]),
    (
        "dp_shard2_zero3_accum2_ac",
        2,
        ["--parallel.dp_shard", "2", "--train.grad_accum", "2", "--parallel.activation_checkpoint", "full"],
    ),
    ("hsdp_2x2", 4, ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"]),
    ("tp2", 2, ["--parallel.tp", "2"]),
    ("tp2_sp", 2, ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"]),
    ("cp2_ring", 2, ["--parallel.cp", "2", "--parallel.cp_impl", "ring"]),
    ("cp2_ulysses", 2, ["--parallel.cp", "2", "--parallel.cp_impl", "ulysses"]),
    ("pp2_gpipe", 2, ["--parallel.pp", "2", "--parallel.pp_schedule", "gpipe", "--parallel.microbatches", "2"]),
    ("pp2_1f1b", 2, ["--parallel.pp", "2", "--parallel.pp_schedule", "1f1b", "--parallel.microbatches", "2"]),
    (
        "pp2_interleaved",
        2,
        [
            "--parallel.pp",
            "2",
            "--parallel.pp_schedule",
            "interleaved_1f1b",
            "--parallel.microbatches",
            "2",
            "--parallel.pp_virtual_stages",
            "2",
        ],
    ),
    (
        "pp2_zero_bubble",
        2,
        [
            "--parallel.pp",
            "2",
            "--parallel.pp_schedule",
            "zero_bubble",
            "--parallel.microbatches",
            "2",
            "--parallel.pp_virtual_stages",
            "2",
        ],
    ),
    ("dp2_tp2", 4, ["--parallel.dp_replicate", "2", "--parallel.tp", "2"]),
    (
        "dp_shard2_tp2",
        4,
        ["--parallel.dp_shard", "2", "--parallel.tp", "2", "--parallel.activation_checkpoint", "selective"],
    ),
    ("dp2_pp2", 4, ["--parallel.dp_replicate", "2", "--parallel.pp", "2", "--parallel.microbatches", "2"]),
    # ZeRO-1 next to tp and pp (Megatron's distributed optimizer): FSDP2 replicates, each rank steps
    # the AdamW state of its own parameters and broadcasts them (tp's shards as local tensors).
    ("dp_shard2_zero1_tp2", 4, ["--parallel.dp_shard", "2", "--parallel.zero_stage", "1", "--parallel.tp", "2"]),
    (
        "dp_shard2_zero1_pp2",
        4,
        [
            "--parallel.dp_shard",
            "2",
            "--parallel.zero_stage",
            "1",
            "--parallel.pp",
            "2",
            "--parallel.microbatches",
            "2",
        ],
    ),
    ("tp2_pp2", 4, ["--parallel.tp", "2", "--parallel.pp", "2", "--parallel.microbatches", "2"]),
    # sequence parallelism across a pipeline (sequence-sharded hidden states between stages) and
    # under FSDP (the norms' scales, summed over tp, then reduce-scattered over dp).
    (
        "tp2_sp_pp2",
        4,
        [
            "--parallel.tp",
            "2",
            "--parallel.sequence_parallel",
            "true",
            "--parallel.pp",
            "2",
            "--parallel.microbatches",
            "2",
        ],
    ),
    ("cp2_tp2_sp", 4, ["--parallel.cp", "2", "--parallel.tp", "2", "--parallel.sequence_parallel", "true"]),
    ("dp_shard2_tp2_sp", 4, ["--parallel.dp_shard", "2", "--parallel.tp", "2", "--parallel.sequence_parallel", "true"]),
    ("pp2_cp2", 4, ["--parallel.pp", "2", "--parallel.cp", "2", "--parallel.microbatches", "2"]),
    ("dc2_dp_shard2_tp2", 8, ["--geo.datacenters", "2", "--parallel.dp_shard", "2", "--parallel.tp", "2"]),
    ("dc2_geo_flat", 4, ["--geo.datacenters", "2", "--parallel.dp_replicate", "2", "--geo.sync", "flat"]),
    (
        "dc2_geo_hierarchical",
        4,
        ["--geo.datacenters", "2", "--parallel.dp_replicate", "2", "--geo.sync", "hierarchical"],
    ),
    # geo strategies with model parallelism inside each datacenter: one geo grid per model part.
    (
        "dc2_tp2_geo_hierarchical",
        4,
        [
            "--geo.datacenters",
            "2",
            "--parallel.tp",
            "2",
            "--parallel.sequence_parallel",
            "true",
            "--geo.sync",
            "hierarchical",
        ],
    ),
    (
        "dc2_pp2_geo_flat",
        4,
        ["--geo.datacenters", "2", "--parallel.pp", "2", "--parallel.microbatches", "2", "--geo.sync", "flat"],
    ),
    ("dc2_cp2_geo_hierarchical", 4, ["--geo.datacenters", "2", "--parallel.cp", "2", "--geo.sync", "hierarchical"]),
    (
        "dc2_dp_shard2_z3_geo_hierarchical",
        4,
        [
            "--geo.datacenters",
            "2",
            "--parallel.dp_shard",
            "2",
            "--parallel.zero_stage",
            "3",
            "--geo.sync",
            "hierarchical",
        ],
    ),
    # train.compile: the blocks (and, outside tensor parallelism, the loss) through torch.compile,
    # against the same eager single-process reference and tolerances.
    (
        "compile_dp_shard2_zero3_ac",
        2,
        ["--train.compile", "true", "--parallel.dp_shard", "2", "--parallel.activation_checkpoint", "full"],
    ),
    ("compile_tp2", 2, ["--train.compile", "true", "--parallel.tp", "2"]),
    (
        "compile_tp2_sp",
        2,
        ["--train.compile", "true", "--parallel.tp", "2", "--parallel.sequence_parallel", "true"],
    ),
    (
        "compile_pp2_1f1b",
        2,
        ["--train.compile", "true", "--parallel.pp", "2", "--parallel.microbatches", "2"],
    ),
    (
        "dp2_tp2_pp2",
        8,
        ["--parallel.dp_replicate", "2", "--parallel.tp", "2", "--parallel.pp", "2", "--parallel.microbatches", "2"],
    ),
]


@pytest.mark.parametrize("name,world,overrides", CASES, ids=[c[0] for c in CASES])
@pytest.mark.slow
def test_layout_matches_single_process(workdir: Path, name: str, world: int, overrides: list[str]) -> None:
    _check(workdir, name, world, overrides)


@pytest.mark.slow
def test_tied_head_at_tp2_matches_its_single_process(workdir: Path) -> None:
    """A tied head under tensor parallelism is the vocab-sharded embedding's own rows (one Parameter)."""
    _check(workdir, "tp2_tied", 2, ["--parallel.tp", "2"], model=("--model.tie_embeddings", "true"))


def _vocab_sharded(vocab: int) -> list[float]:
    """Embedding, head and loss sharded over a TP group whose size does not divide ``vocab``, against
    the plain modules and F.cross_entropy on every rank: outputs, loss, the full weights' gradients."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from isthmus.parallel.shm_collectives import build_collectives
    from isthmus.parallel.tp import VocabShardedEmbedding, VocabShardedHead, is_vocab_sharded
    from isthmus.train.step import cross_entropy

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    embedding, head = nn.Embedding(vocab, 8), nn.Linear(8, vocab, bias=False)
    ids, targets = torch.randint(0, vocab, (3, 5)), torch.randint(0, vocab, (3, 5))
    comm = build_collectives(mesh.get_group(), timeout_s=60)
    sharded_embedding = VocabShardedEmbedding(embedding, mesh, comm)
    sharded_head = VocabShardedHead(head, mesh, comm)
    rows, plain_rows = sharded_embedding(ids), embedding(ids)
    logits, plain_logits = sharded_head(rows), head(plain_rows)
    assert isinstance(logits, DTensor) and is_vocab_sharded(logits)
    loss, plain_loss = cross_entropy(logits, targets), F.cross_entropy(plain_logits.flatten(0, 1), targets.flatten())
    loss.backward()
    plain_loss.backward()
    errors = [float((rows - plain_rows).abs().max()), float((logits.full_tensor() - plain_logits).abs().max())]
    errors.append(abs(float(loss) - float(plain_loss)))
    for sharded, plain in ((sharded_embedding.weight, embedding.weight), (sharded_head.weight, head.weight)):
        errors.append(float((sharded.grad.full_tensor() - plain.grad).abs().max()))
    return errors


@pytest.mark.slow
def test_vocab_sharded_embedding_and_head_with_a_vocabulary_the_group_does_not_divide() -> None:
    for errors in run_ranks(_vocab_sharded, 3, 10):  # shards of 4, 4 and 2 rows
        assert errors[0] == 0.0, errors  # the looked-up rows: one non-zero term per sum, exact
        assert max(errors[1:]) < 1e-5, errors
