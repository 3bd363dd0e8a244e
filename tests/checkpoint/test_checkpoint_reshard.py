"""A checkpoint saved under one layout resumes under another and training continues as if uninterrupted.

Each case trains 6 steps under layout A on real gloo ranks (checkpoints at steps 3 and 6), then
resumes A's step-3 checkpoint under layout B for steps 4-6. Steps 1-3 of A and 4-6 of B must match
the uninterrupted single-process run of the same seed with the tolerances of
`test_parallel_equivalence` (every loss and gradient norm 1e-5 relative, final parameters 5e-5
relative in norm per tensor; its docstring gives the reasons). Resuming under the same layout must
be bit-identical.

The data is sized so that one epoch (41 windows of 32 tokens) ends inside the run: the data check
follows every sample by its global position across the change of data-parallel size.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from multirank import run_ranks

STEPS, AT, BATCH = 6, 3, 8
BASE = [
    "--model.flavor",
    "tiny",
    "--train.steps",
    str(STEPS),
    "--train.batch_size",
    str(BATCH),
    "--train.seq_len",
    "32",
    "--train.warmup_steps",
    "2",
    "--train.val_every",
    "0",
    "--train.val_batches",
    "1",
    "--data.max_bytes",
    "1400",
    "--metrics.progress",
    "false",
    "--train.threads",
    "1",
    "--checkpoint.every",
    str(AT),
]
RTOL = 1e-5
PARAM_RTOL = 5e-5
Run = tuple[list[float], list[float], list[tuple[int, int]], int]
"""losses, gradient norms, (global sample position, window) drawn by this rank, windows per epoch."""


def _train(overrides: list[str], run_dir: str, cache_dir: str) -> Run:
    """One rank of a run (or the whole run in this process), recording the windows it trains on."""
    import torch.distributed as dist

    from isthmus.config import build_config, parse_overrides
    from isthmus.data.loader import BatchSampler, rank_slice
    from isthmus.launch.preflight import preflight
    from isthmus.train.trainer import train

    args = [*BASE, *overrides, "--train.run_dir", run_dir, "--data.cache_dir", cache_dir]
    if dist.is_initialized():
        args += ["--parallel.nproc", str(dist.get_world_size())]
    cfg = build_config(None, parse_overrides(args))
    preflight(cfg)
    drawn: list[tuple[int, int]] = []
    n_windows = [0]
    original = BatchSampler.next_batch

    def recording(self: BatchSampler, global_batch: int, dp_rank: int = 0, dp_size: int = 1):  # noqa: ANN202
        share = rank_slice(global_batch, dp_rank, dp_size)
        ids = self.sample_ids(global_batch)[share]
        drawn.extend((self.samples_seen + share.start + i, int(w)) for i, w in enumerate(ids))
        n_windows[0] = self.n_windows
        return original(self, global_batch, dp_rank, dp_size)

    BatchSampler.next_batch = recording  # type: ignore[method-assign]
    try:
        result = train(cfg)
    finally:
        BatchSampler.next_batch = original  # type: ignore[method-assign]
    return result.losses, result.grad_norms, drawn, n_windows[0]


def _run(root: Path, name: str, world: int, overrides: list[str]) -> list[Run]:
    args = (overrides, str(root / name), str(root / "cache"))
    return [_train(*args)] if world == 1 else run_ranks(_train, world, *args)


@functools.cache
def _saved(root: Path, name: str, world: int, overrides: tuple[str, ...]) -> list[Run]:
    """Layout A's uninterrupted run (checkpointed at steps 3 and 6), once per module."""
    return _run(root, name, world, list(overrides))


def _final(root: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(root / name / "final" / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("reshard")


def _reference(root: Path) -> Run:
    return _saved(root, "single", 1, ())[0]


Layout = tuple[str, int, tuple[str, ...]]
SINGLE: Layout = ("single", 1, ())
PP2: Layout = ("pp2", 2, ("--parallel.pp", "2", "--parallel.microbatches", "2"))
# Saved compiled (torch.compile's wrapper adds `_orig_mod` to every block parameter's name): its
# checkpoint resumes eager, under another layout, as any other.
ZERO3_ASYNC: Layout = (
    "dp_shard2_zero3_async_compiled",
    2,
    (
        "--parallel.dp_shard",
        "2",
        "--parallel.zero_stage",
        "3",
        "--checkpoint.async_save",
        "true",
        "--train.compile",
        "true",
    ),
)
TP2_PP2: Layout = ("tp2_pp2", 4, ("--parallel.tp", "2", "--parallel.pp", "2", "--parallel.microbatches", "2"))
TP2_SP: Layout = ("tp2_sp", 2, ("--parallel.tp", "2", "--parallel.sequence_parallel", "true"))
DP2: Layout = ("dp_replicate2", 2, ("--parallel.dp_replicate", "2"))
ZERO1: Layout = ("dp_shard2_zero1", 2, ("--parallel.dp_shard", "2", "--parallel.zero_stage", "1"))
ZERO1_TP2: Layout = (
    "dp_shard2_zero1_tp2",
    4,
    ("--parallel.dp_shard", "2", "--parallel.zero_stage", "1", "--parallel.tp", "2"),
)

CASES: list[tuple[str, Layout, int, list[str]]] = [
    ("pp2_to_tp2", PP2, 2, ["--parallel.tp", "2"]),
    ("zero3_async_compiled_to_single", ZERO3_ASYNC, 1, []),
    ("tp2_sp_to_pp2", TP2_SP, 2, ["--parallel.pp", "2", "--parallel.microbatches", "2"]),
    ("tp2_pp2_to_dp_shard4", TP2_PP2, 4, ["--parallel.dp_shard", "4"]),
    ("dp_replicate2_to_4", DP2, 4, ["--parallel.dp_replicate", "4"]),
    (
        "zero1_to_pp2_interleaved",
        ZERO1,
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
    ("single_to_zero1", SINGLE, 2, ["--parallel.dp_shard", "2", "--parallel.zero_stage", "1"]),
    # ZeRO-1's AdamW state of tp's shards, saved by each shard's owner, resumed by other owners.
    (
        "zero1_tp2_to_zero1_pp2",
        ZERO1_TP2,
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
]


@functools.cache
def _resumed(root: Path, name: str, saved: Layout, world: int, overrides: tuple[str, ...]) -> list[Run]:
    """Layout B's run from A's step-3 checkpoint, once per module."""
    checkpoint = root / saved[0] / "checkpoints" / f"step-{AT:06d}"
    return _run(root, name, world, [*overrides, "--checkpoint.resume", str(checkpoint), "--checkpoint.every", "0"])


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name,saved,world,overrides", CASES, ids=[c[0] for c in CASES])
@pytest.mark.slow
def test_resume_under_another_layout(workdir: Path, name: str, saved: Layout, world: int, overrides: list[str]) -> None:
    ref_losses, ref_norms, _, _ = _reference(workdir)
    before = _saved(workdir, *saved)[0]
    after = _resumed(workdir, name, saved, world, tuple(overrides))
    assert all(r[:2] == after[0][:2] for r in after), "ranks disagree on the logged loss or gradient norm"
    losses, norms = before[0][:AT] + after[0][0], before[1][:AT] + after[0][1]
    assert len(losses) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=RTOL, atol=0)
    ref_params, params = _final(workdir, "single"), _final(workdir, name)
    assert params.keys() == ref_params.keys()
    rels = {k: float((params[k] - ref).norm() / ref.norm()) for k, ref in ref_params.items()}
    worst = max(rels, key=rels.__getitem__)
    assert rels[worst] < PARAM_RTOL, f"{name}: {worst} differs by {rels[worst]:.2e} (relative norm)"
    print(
        f"{name}: loss {_rel(losses, ref_losses):.1e}, grad norm {_rel(norms, ref_norms):.1e}, params {rels[worst]:.1e}"
    )


@pytest.mark.slow
def test_data_position_survives_a_change_of_dp_size(workdir: Path) -> None:
    """dp_replicate 2 -> 4 at step 3: every window of the epoch is trained on exactly once, in order."""
    before = _saved(workdir, *DP2)
    after = _resumed(workdir, "dp_replicate2_to_4", DP2, 4, ("--parallel.dp_replicate", "4"))
    n_windows = before[0][3]
    assert AT * BATCH < n_windows < STEPS * BATCH, "resize the data: the epoch must end after the resume point"
    drawn = [d for run in before for d in run[2] if d[0] < AT * BATCH] + [d for run in after for d in run[2]]
    positions = sorted(p for p, _ in drawn)
    assert positions == list(range(STEPS * BATCH)), "a sample position was skipped or drawn twice"
    window_at = dict(drawn)
    assert sorted(window_at[p] for p in range(n_windows)) == list(range(n_windows)), "epoch 0 is not each window once"
    second = [window_at[p] for p in range(n_windows, STEPS * BATCH)]
    assert len(set(second)) == len(second)
    # and it is the order one process draws
    from isthmus.data.loader import BatchSampler

    sampler = BatchSampler(torch.zeros(n_windows * 32 + 1).numpy(), 32, seed=0)
    assert [window_at[p] for p in range(STEPS * BATCH)] == sampler.sample_ids(STEPS * BATCH).tolist()


@pytest.mark.slow
def test_resume_under_the_same_layout_is_exact(workdir: Path) -> None:
    """FSDP2 on 2 ranks, saved asynchronously: bit-identical losses and final parameters."""
    before = _saved(workdir, *ZERO3_ASYNC)[0]
    after = _resumed(workdir, "zero3_again", ZERO3_ASYNC, 2, ZERO3_ASYNC[2])[0]
    assert after[0] == before[0][AT:] and after[1] == before[1][AT:]
    ref = _final(workdir, ZERO3_ASYNC[0])
    for key, value in _final(workdir, "zero3_again").items():
        assert torch.equal(value, ref[key]), key
