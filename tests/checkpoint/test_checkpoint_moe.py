"""A MoE checkpoint saved under expert parallelism resumes without it (and at tp 2), as if uninterrupted.

The harness and tolerances of `test_checkpoint_reshard`: 6 steps, checkpoints at step 3; steps 1-3 of
the saved run and 4-6 of the resumed one against the uninterrupted single-process run. The experts
are DTensors sharded by expert (and by FSDP), the routers' expert_bias (the bias method's state) a
parameter, so DCP reshards both like every other tensor.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from test_checkpoint_reshard import AT, PARAM_RTOL, RTOL, STEPS, Run, _final, _run

MOE = ["--model.flavor", "moe-tiny", "--model.load_balance", "bias", "--model.bias_update_rate", "0.01"]
EP2 = ["--parallel.dp_shard", "2", "--parallel.ep", "2"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe_reshard")


@functools.cache
def _uninterrupted(root: Path) -> tuple[Run, Run]:
    """The single-process reference and the ep-2 run that saves, once per module."""
    return _run(root, "single", 1, MOE)[0], _run(root, "ep2", 2, [*MOE, *EP2])[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,world,overrides",
    [("ep1", 1, []), ("ep1_dp_shard2", 2, ["--parallel.dp_shard", "2"]), ("tp2", 2, ["--parallel.tp", "2"])],
)
def test_ep2_checkpoint_resumes_elsewhere(workdir: Path, name: str, world: int, overrides: list[str]) -> None:
    ref, saved = _uninterrupted(workdir)
    checkpoint = workdir / "ep2" / "checkpoints" / f"step-{AT:06d}"
    resume = [*MOE, *overrides, "--checkpoint.resume", str(checkpoint), "--checkpoint.every", "0"]
    after = _run(workdir, name, world, resume)[0]
    losses, norms = saved[0][:AT] + after[0], saved[1][:AT] + after[1]
    assert len(losses) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref[1]), rtol=RTOL, atol=0)
    ref_params, params = _final(workdir, "single"), _final(workdir, name)
    assert params.keys() == ref_params.keys()
    for key, value in ref_params.items():
        rel = float((params[key] - value).norm() / value.norm())
        assert rel < PARAM_RTOL, f"{name}: {key} differs by {rel:.2e}"
    assert all(v.norm() > 0 for k, v in params.items() if k.endswith("expert_bias"))
