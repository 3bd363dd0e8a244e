"""Layout mistakes are one-line errors (exit 2) before any process starts, naming the numbers."""

from __future__ import annotations

import pytest

from isthmus.cli import main

TINY = ["--config", "tiny", "--train.batch_size", "8", "--train.seq_len", "32"]

BAD_LAYOUTS = [
    (
        ["--parallel.nproc", "4", "--parallel.dp_replicate", "1", "--parallel.dp_shard", "2"],
        "must equal dp_replicate*dp_shard*cp*tp*pp = 1*2*1*1*1 = 2",
    ),
    (
        ["--parallel.nproc", "3", "--parallel.tp", "2"],
        "parallel.nproc = 3: must be a multiple of dp_shard*cp*tp*pp = 1*1*2*1 = 2 (parallel.dp_replicate = -1 fills",
    ),
    (
        ["--parallel.nproc", "4", "--parallel.dp_shard", "-1", "--parallel.pp", "3"],
        "must be a multiple of dp_replicate*cp*tp*pp = 1*1*1*3 = 3 (parallel.dp_shard = -1 fills",
    ),
    (
        ["--parallel.nproc", "4", "--geo.datacenters", "2", "--parallel.tp", "4"],
        "must be a multiple of datacenters*dp_shard*cp*tp*pp = 2*1*1*4*1 = 8",
    ),
    (["--parallel.dp_replicate", "-2"], "parallel.dp_replicate = -2: must be at least 1, or -1 to fill"),
    (["--parallel.nproc", "3", "--parallel.tp", "3"], "must divide model.n_heads = 4"),
    (["--parallel.nproc", "4", "--parallel.tp", "4"], "must divide model.n_kv_heads = 2"),
    (["--parallel.nproc", "8", "--parallel.pp", "8"], "8 stages is more than model.n_layers = 4"),
    (
        ["--parallel.nproc", "2", "--parallel.cp", "2", "--train.seq_len", "30"],
        "2*cp = 4 must divide train.seq_len = 30",
    ),
    (
        ["--parallel.nproc", "2", "--parallel.dp_replicate", "2", "--train.batch_size", "3"],
        "divisible by dp (2) x grad_accum (1) = 2",
    ),
    (["--parallel.nproc", "2", "--parallel.pp", "2", "--parallel.microbatches", "3"], "microbatches (3) = 3"),
    # Expert parallelism (issue 33).
    (["--parallel.nproc", "2", "--parallel.ep", "2"], "parallel.ep = 2: needs a MoE model"),
    (
        ["--model.flavor", "moe-tiny", "--parallel.nproc", "2", "--parallel.dp_replicate", "2", "--parallel.ep", "2"],
        "parallel.ep = 2: must divide parallel.dp_shard x parallel.cp = 1",
    ),
    (
        ["--model.flavor", "moe-tiny", "--parallel.nproc", "2", "--parallel.ep", "2", "--parallel.zero_stage", "1"],
        "ZeRO-1 (DDP) cannot hold expert-sharded weights",
    ),
    (
        ["--model.flavor", "moe-tiny", "--parallel.nproc", "2", "--parallel.cp", "2", "--model.capacity_factor", "1"],
        "parallel.cp = 2: is not combined with model.capacity_factor > 0 yet",
    ),
    (
        [
            "--parallel.nproc",
            "2",
            "--parallel.pp",
            "2",
            "--parallel.pp_schedule",
            "interleaved_1f1b",
            "--parallel.microbatches",
            "2",
        ],
        "pp_virtual_stages",
    ),
    (
        [
            "--parallel.nproc",
            "2",
            "--parallel.pp",
            "2",
            "--parallel.pp_schedule",
            "gpipe",
            "--parallel.pp_virtual_stages",
            "2",
            "--parallel.microbatches",
            "2",
        ],
        "pp_virtual_stages",
    ),
    (
        [
            "--parallel.nproc",
            "2",
            "--parallel.pp",
            "2",
            "--parallel.pp_schedule",
            "1f1b",
            "--parallel.microbatches",
            "1",
        ],
        "microbatches",
    ),
    (["--parallel.pp_virtual_stages", "2"], "needs parallel.pp > 1"),
    (["--parallel.sequence_parallel", "true"], "needs parallel.tp > 1"),
    (
        [
            "--parallel.nproc",
            "2",
            "--parallel.pp",
            "2",
            "--parallel.microbatches",
            "2",
            "--model.tie_embeddings",
            "true",
        ],
        "tie_embeddings",
    ),
    (["--geo.sync", "diloco"], "needs geo.datacenters of 2 or more"),
    (
        [
            "--parallel.nproc",
            "4",
            "--geo.datacenters",
            "2",
            "--parallel.dp_replicate",
            "1",
            "--parallel.dp_shard",
            "2",
            "--parallel.zero_stage",
            "1",
            "--geo.sync",
            "flat",
        ],
        "parallel.zero_stage = 1: ZeRO-1 does not run under geo.sync",
    ),
    (
        [
            "--parallel.nproc",
            "2",
            "--geo.datacenters",
            "2",
            "--parallel.dp_replicate",
            "1",
            "--parallel.tp",
            "2",
            "--geo.sync",
            "diloco",
            "--geo.fault_tolerant",
            "true",
        ],
        "parallel.tp = 2: is not combined with geo.fault_tolerant",
    ),
    (
        ["--parallel.nproc", "3", "--geo.datacenters", "2", "--parallel.dp_replicate", "2"],
        "must equal datacenters*dp_replicate*dp_shard*cp*tp*pp = 2*2*1*1*1*1 = 4",
    ),
    (["--geo.inner_steps", "0"], "geo.inner_steps = 0: must be at least 1"),
    (
        [
            "--parallel.nproc",
            "4",
            "--geo.datacenters",
            "2",
            "--geo.dc_axis",
            "pp",
            "--parallel.pp",
            "1",
            "--parallel.dp_replicate",
            "4",
        ],
        "parallel.pp = 1: must be a multiple of geo.datacenters = 2 with geo.dc_axis = pp",
    ),
    (
        [
            "--parallel.nproc",
            "4",
            "--geo.datacenters",
            "2",
            "--geo.dc_axis",
            "pp",
            "--parallel.pp",
            "2",
            "--parallel.dp_replicate",
            "2",
            "--parallel.microbatches",
            "2",
            "--geo.sync",
            "flat",
        ],
        "geo.sync = 'flat': must be none with geo.dc_axis = pp",
    ),
    (
        [
            "--parallel.nproc",
            "4",
            "--geo.datacenters",
            "2",
            "--geo.dc_axis",
            "pp",
            "--parallel.pp",
            "2",
            "--parallel.dp_replicate",
            "1",
            "--parallel.microbatches",
            "2",
        ],
        "must equal dp_replicate*dp_shard*cp*tp*pp = 1*1*1*1*2 = 2",
    ),
    (
        ["--parallel.nproc", "8", "--parallel.cp", "8", "--parallel.cp_impl", "ulysses"],
        "ulysses needs cp to divide the heads per tensor-parallel rank, n_heads/tp = 4",
    ),
]


@pytest.mark.parametrize("args,needle", BAD_LAYOUTS, ids=[" ".join(a[2:] if len(a) > 2 else a) for a, _ in BAD_LAYOUTS])
def test_bad_layout_is_one_line_before_any_process(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", *TINY, "--train.run_dir", str(run_dir), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("isthmus: error:"), err
    assert needle in err[0], err[0]
    assert not run_dir.exists()  # nothing started: no run directory, no logs


FILLED = [
    # (named on top of the shipped default config, what the data-parallel degrees become)
    (["--parallel.nproc", "1"], {"dp_replicate": 1, "dp_shard": 1}),
    ([], {"nproc": 2, "dp_replicate": 2, "dp_shard": 1}),
    (["--parallel.tp", "2"], {"dp_replicate": 1, "tp": 2}),
    (["--parallel.dp_shard", "2", "--parallel.zero_stage", "3"], {"dp_replicate": 1, "dp_shard": 2}),
    (["--parallel.nproc", "4", "--parallel.tp", "2"], {"dp_replicate": 2, "dp_shard": 1, "tp": 2}),
    (["--parallel.nproc", "4", "--parallel.dp_shard", "-1"], {"dp_replicate": 1, "dp_shard": 4}),
    (
        ["--parallel.nproc", "4", "--parallel.dp_shard", "-1", "--parallel.dp_replicate", "2"],
        {"dp_replicate": 2, "dp_shard": 2},
    ),
    (["--parallel.nproc", "4", "--geo.datacenters", "2"], {"dp_replicate": 2}),
    # ep folds over dp_shard x cp: with nothing else named, dp_shard fills.
    (["--model.flavor", "moe-tiny", "--parallel.ep", "2"], {"dp_replicate": 1, "dp_shard": 2, "ep": 2}),
]


@pytest.mark.parametrize("args,expected", FILLED, ids=[" ".join(a) or "default" for a, _ in FILLED])
def test_data_parallel_degree_fills_what_named_degrees_leave(
    args: list[str], expected: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    """The shipped default config plus what a user types: the resolved config states the degrees it runs."""
    import tomllib

    assert main(["train", "--model.flavor", "tiny", *args, "--print-config"]) == 0
    parallel = tomllib.loads(capsys.readouterr().out)["parallel"]
    assert {k: parallel[k] for k in expected} == expected
