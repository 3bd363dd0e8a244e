"""`isthmus.parallelize` for custom loops: the example under the real launcher, and sharded == unsharded."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import isthmus
from isthmus.api import clip_grad_norm, step
from isthmus.models.flavors import get_flavor
from multirank import free_port, run_ranks

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_loop.py"
STEPS = 12


def _run_example(*launcher: str, flags: tuple[str, ...] = ()) -> list[float]:
    """Run the example, check it exits 0, return rank 0's printed losses."""
    cmd = [sys.executable, *launcher, str(EXAMPLE), "--steps", str(STEPS), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=EXAMPLE.parents[1])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss (\S+)", proc.stdout, flags=re.M)]
    assert len(losses) == STEPS, proc.stdout
    return losses


def _assert_falls(losses: list[float]) -> None:
    assert all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses


@pytest.mark.slow
def test_example_under_torchrun_with_tp() -> None:
    torchrun = (
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
    )
    _assert_falls(_run_example(*torchrun, flags=("--tp", "2")))


@pytest.mark.slow
def test_example_in_one_process() -> None:
    _assert_falls(_run_example())


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def _first_step(world: int, dp_rank: int) -> tuple[float, float]:
    """(local loss, global grad norm) of one forward/backward, on this rank's slice of the batch."""
    dims = isthmus.ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, world_size=world)
    pm = isthmus.parallelize(isthmus.build_model(get_flavor("tiny"), "meta"), dims, device="cpu", seed=3)
    inputs, targets = (t.chunk(world)[dp_rank] for t in _batch())
    loss = step(pm, inputs, targets)
    assert loss is not None
    return float(loss), clip_grad_norm(pm, math.inf, None)


def _sharded_rank() -> tuple[float, float]:
    import torch.distributed as dist

    return _first_step(2, dist.get_rank())


@pytest.mark.slow
def test_dp_shard_matches_single_process() -> None:
    loss, norm = _first_step(1, 0)
    results = run_ranks(_sharded_rank, 2, timeout=120)
    # Each rank's loss is the mean over its half of the batch; FSDP averages the gradients.
    assert sum(r[0] for r in results) / 2 == pytest.approx(loss, rel=1e-5)
    for _, rank_norm in results:
        assert rank_norm == pytest.approx(norm, rel=1e-5)


def _bf16_step(world: int, dp_rank: int) -> dict[str, object]:
    """One bf16 forward/backward through ``isthmus.parallelize(..., dtype="bf16")``: the dtypes that
    block 0's wq multiplied with and produced, and what the optimizer will see."""
    dims = isthmus.ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, world_size=world)
    model = isthmus.build_model(get_flavor("tiny"), "meta")
    pm = isthmus.parallelize(model, dims, device="cpu", seed=3, dtype="bf16")
    seen: dict[str, object] = {}
    wq = pm.model.layers["0"].attention.wq

    def record(module: torch.nn.Module, _: object, out: torch.Tensor) -> None:
        seen.update(weight=module.weight.dtype, output=out.dtype)

    wq.register_forward_hook(record)
    inputs, targets = (t.chunk(world)[dp_rank] for t in _batch())
    loss = step(pm, inputs, targets)
    assert loss is not None
    params = pm.parameters()
    return {
        **seen,
        "autocast": pm.autocast,
        "loss": float(loss),
        "masters": {p.dtype for p in params},
        "grads": {p.grad.dtype for p in params if p.grad is not None},
    }


def _bf16_sharded_rank() -> dict[str, object]:
    import torch.distributed as dist

    return _bf16_step(2, dist.get_rank())


@pytest.mark.slow
def test_bf16_computes_under_fsdp_mixed_precision_where_fsdp_holds_the_weights() -> None:
    # One process: fp32 weights under autocast (its cast makes the bf16 copy, wq's output is bf16).
    alone = _bf16_step(1, 0)
    assert alone["autocast"] is True and alone["weight"] == torch.float32 and alone["output"] == torch.bfloat16
    # FSDP (ZeRO-3 over 2 ranks): no autocast; FSDP gathers bf16 weights over fp32 shards, and the
    # optimizer steps fp32 masters with fp32 (reduced) gradients.
    results = run_ranks(_bf16_sharded_rank, 2, timeout=120)
    for r in results:
        assert r["autocast"] is False and r["weight"] == torch.bfloat16 and r["output"] == torch.bfloat16
        assert r["masters"] == {torch.float32} and r["grads"] == {torch.float32}
    # Both bf16 computations of the same batch: the residual stream is bf16 under FSDP, fp32 under
    # autocast, so the mean loss agrees to bf16's rounding, not exactly (measured: 5.5e-5 relative).
    assert sum(float(r["loss"]) for r in results) / 2 == pytest.approx(float(alone["loss"]), rel=1e-3)


def test_weights_of_a_real_model_are_reinitialised_from_seed() -> None:
    dims = isthmus.ParallelDims(1, 1, 1, 1, 1, world_size=1)
    real = isthmus.build_model(get_flavor("tiny"), "cpu")
    a = isthmus.parallelize(real, dims, device="cpu", seed=3).model
    b = isthmus.parallelize(isthmus.build_model(get_flavor("tiny"), "meta"), dims, device="cpu", seed=3).model
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name


def test_world_size_without_process_group_is_one_line_error() -> None:
    dims = isthmus.ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, world_size=2)
    with pytest.raises(isthmus.IsthmusError) as err:
        isthmus.parallelize(isthmus.build_model(get_flavor("tiny"), "meta"), dims)
    message = str(err.value)
    assert "\n" not in message and "torchrun" in message and "layout.world = 2" in message


def test_a_layout_spec_sets_what_dims_cannot() -> None:
    from isthmus.layout import LayoutSpec

    lay = LayoutSpec(activation_checkpoint="full")
    pm = isthmus.parallelize(isthmus.build_model(get_flavor("tiny"), "meta"), lay, device="cpu", seed=3)
    assert type(pm.model.layers["0"]).__name__ == "CheckpointWrapper"
    with pytest.raises(isthmus.IsthmusError, match=r"^parallel.sequence_parallel = True: needs parallel.tp > 1$"):
        isthmus.parallelize(isthmus.build_model(get_flavor("tiny"), "meta"), LayoutSpec(sequence_parallel=True))
    with pytest.raises(isthmus.IsthmusError, match=r"^sync = 'diloco': is run by isthmus train"):
        isthmus.parallelize(
            isthmus.build_model(get_flavor("tiny"), "meta"), LayoutSpec(datacenters=2, dc_axis="dp", sync="diloco")
        )
