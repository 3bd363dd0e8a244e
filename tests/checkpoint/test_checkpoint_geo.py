"""Checkpoints of runs across datacenters (geo.sync) resume exactly, on real gloo ranks.

Each case trains 6 steps on 2 datacenters (checkpoints at steps 3 and 6), then resumes the step-3
checkpoint under the same layout for steps 4-6. Bit-identity, not a tolerance: every loss and
gradient norm of steps 4-6, and every tensor of the two step-6 checkpoints (both datacenters'
models and inner AdamW states, every rank's geo state and RNG), must equal the uninterrupted run's.
The step-3 checkpoints are taken where the strategies' state matters: DiLoCo (H = 2) between two
outer steps, when the datacenters hold different models; Streaming DiLoCo with a fragment's
transfer in flight (launched after step 2, applied after step 4); compressed with its error
feedback residuals; DiLoCo again with tensor parallelism, and with FSDP, inside each datacenter.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch

from multirank import run_ranks

STEPS, AT = 6, 3
BASE = [
    "--model.flavor",
    "tiny",
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
    "4000",
    "--metrics.progress",
    "false",
    "--train.threads",
    "1",
    "--checkpoint.every",
    str(AT),
]
GEO = ["--geo.datacenters", "2"]
CASES = {
    "diloco_2x2": (4, ["--parallel.dp_replicate", "2", "--geo.sync", "diloco", "--geo.inner_steps", "2"]),
    "streaming_2x1": (
        2,
        [
            "--geo.sync",
            "streaming_diloco",
            "--geo.inner_steps",
            "4",
            "--geo.fragments",
            "2",
            "--geo.overlap_steps",
            "2",
        ],
    ),
    "compressed_2x1": (2, ["--geo.sync", "compressed", "--geo.wan_dtype", "int8"]),
    # tensor parallelism inside each datacenter: DTensor shards, per-shard outer state.
    "diloco_2xtp2": (4, ["--parallel.tp", "2", "--geo.sync", "diloco", "--geo.inner_steps", "2"]),
    # FSDP (ZeRO-2) inside each datacenter: the outer state of each shard.
    "diloco_2xfsdp2": (
        4,
        ["--parallel.dp_shard", "2", "--parallel.zero_stage", "2", "--geo.sync", "diloco", "--geo.inner_steps", "2"],
    ),
}


def _train(overrides: list[str], run_dir: str, cache_dir: str) -> tuple[list[float], list[float]]:
    import torch.distributed as dist

    from isthmus.config import build_config, parse_overrides
    from isthmus.launch.preflight import preflight
    from isthmus.train.trainer import train

    args = [
        *BASE,
        *GEO,
        *overrides,
        "--train.run_dir",
        run_dir,
        "--data.cache_dir",
        cache_dir,
        "--parallel.nproc",
        str(dist.get_world_size()),
    ]
    cfg = build_config(None, parse_overrides(args))
    preflight(cfg)
    result = train(cfg)
    return result.losses, result.grad_norms


@functools.cache
def _pair(root: Path, case: str) -> tuple[tuple[list[float], list[float]], tuple[list[float], list[float]]]:
    """(uninterrupted run, run resumed from its step-3 checkpoint), once per case."""
    world, overrides = CASES[case]
    straight = run_ranks(_train, world, overrides, str(root / case), str(root / "cache"))[0]
    resumed_dir = root / f"{case}-resumed"
    shutil.copytree(root / case / "checkpoints" / "step-000003", resumed_dir / "checkpoints" / "step-000003")
    resumed = run_ranks(
        _train, world, [*overrides, "--checkpoint.resume", "auto"], str(resumed_dir), str(root / "cache")
    )[0]
    return straight, resumed


def _all_entries(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whoever saved it."""
    import warnings

    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    tree = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tree, checkpoint_id=str(path), no_dist=True)
    return tree


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("geo-ckpt")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_geo_run_resumes_exactly(root: Path, case: str) -> None:
    (losses, norms), (r_losses, r_norms) = _pair(root, case)
    assert len(losses) == STEPS and len(r_losses) == STEPS - AT
    assert r_losses == losses[AT:] and r_norms == norms[AT:]
    a = _all_entries(root / case / "checkpoints" / "step-000006")
    b = _all_entries(root / f"{case}-resumed" / "checkpoints" / "step-000006")
    assert a.keys() == b.keys()
    assert any(k.startswith("geo.rank1.") for k in a), "every rank saves its geo state"
    if case.startswith(("diloco", "streaming")):
        # Datacenter 1 keeps its own model and inner optimizer state (for both of its ranks once).
        assert any(k.startswith("dc1.model.") for k in a) and any(k.startswith("dc1.optim.") for k in a)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ[:5]


@pytest.mark.slow
def test_diloco_checkpoint_holds_each_datacenters_model(root: Path) -> None:
    """Saved between outer steps, the two datacenters' models differ; both are in the checkpoint."""
    _pair(root, "diloco_2x2")
    saved = _all_entries(root / "diloco_2x2" / "checkpoints" / "step-000003")
    names = [k[len("model.") :] for k in saved if k.startswith("model.")]
    assert names and all(f"dc1.model.{n}" in saved for n in names)
    assert any(not torch.equal(saved[f"model.{n}"], saved[f"dc1.model.{n}"]) for n in names)


@pytest.mark.slow
def test_other_layout_is_refused_in_one_line_and_a_run_without_geo_loads_it(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from isthmus.cli import main
    from isthmus.log import setup_logging

    _pair(root, "diloco_2x2")
    ckpt = root / "diloco_2x2" / "checkpoints" / "step-000003"
    common = [*BASE, "--data.cache_dir", str(root / "cache"), "--checkpoint.resume", str(ckpt)]
    # 2 datacenters of 1 rank: DiLoCo's per-rank outer state was saved for 2 x 2.
    rc = main(
        [
            "train",
            *common,
            *GEO,
            "--parallel.nproc",
            "2",
            "--parallel.dp_replicate",
            "1",
            "--geo.sync",
            "diloco",
            "--geo.inner_steps",
            "2",
            "--train.run_dir",
            str(tmp_path / "other"),
        ]
    )
    err = capsys.readouterr().err
    setup_logging(console=False)
    assert rc == 2
    lines = [line for line in err.splitlines() if "isthmus: error:" in line]
    assert len(lines) == 1 and "can resume it only with the same layout" in lines[0], err[-2000:]
    # One process, no geo.sync: datacenter 0's model and optimizer state, training goes on.
    assert (
        main(
            [
                "train",
                *common,
                "--parallel.nproc",
                "1",
                "--parallel.dp_replicate",
                "1",
                "--train.run_dir",
                str(tmp_path / "single"),
            ]
        )
        == 0
    )
    assert (tmp_path / "single" / "final" / "model.pt").is_file()
