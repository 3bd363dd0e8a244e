"""One layout record: the layout's fields are declared once in the config and once in `LayoutSpec`,
the trainer, the API and the planner build from it, every field round-trips config -> spec ->
planner -> spec -> config unchanged, and `isthmus plan --json` speaks only config keys."""

from __future__ import annotations

import dataclasses
import inspect
import json
import typing
from pathlib import Path
from typing import Any

import pytest

from isthmus.cli import plan as plan_cli
from isthmus.cli.common import ArgumentParser
from isthmus.config import JobConfig, section_fields, set_value, validate
from isthmus.layout import rules
from isthmus.layout.spec import DERIVED, GEO_KEYS, PARALLEL_KEYS, LayoutSpec
from isthmus.models.args import ModelArgs
from isthmus.planner.cost import estimate
from isthmus.planner.topology import load_topology
from isthmus.planner.workload import RUNTIMES, Workload

ARGS = ModelArgs(dim=256, n_layers=8, n_heads=8, n_kv_heads=8, vocab_size=512, ffn_dim=512)

# (topology, devices, config values): between them every field takes a value other than its default.
CASES: list[tuple[str, int, dict[str, Any]]] = [
    (
        "selene-a100",
        16,
        {
            "parallel.nproc": 16,
            "parallel.tp": 2,
            "parallel.sequence_parallel": True,
            "parallel.cp": 2,
            "parallel.cp_impl": "ulysses",
            "parallel.ep": 2,
            "parallel.pp": 2,
            "parallel.pp_schedule": "interleaved_1f1b",
            "parallel.pp_virtual_stages": 2,
            "parallel.microbatches": 4,
            "parallel.dp_shard": 2,
            "parallel.dp_replicate": 1,
            "parallel.zero_stage": 2,
            "parallel.activation_checkpoint": "selective",
            "train.batch_size": 16,
            "train.seq_len": 256,
        },
    ),
    (
        "selene-a100",
        4,
        {
            "parallel.nproc": 4,
            "parallel.dp_replicate": 2,
            "parallel.dp_shard": 2,
            "parallel.zero_stage": 3,
            "train.grad_accum": 4,
            "parallel.activation_checkpoint": "full",
            "train.batch_size": 32,
            "train.seq_len": 128,
        },
    ),
    (
        "emulated-2dc",
        4,
        {
            "parallel.nproc": 4,
            "parallel.dp_replicate": 2,
            "parallel.dp_shard": 1,
            "geo.datacenters": 2,
            "geo.dc_axis": "dp",
            "geo.sync": "streaming_diloco",
            "geo.inner_steps": 20,
            "geo.fragments": 2,
            "geo.overlap_steps": 3,
            "geo.outer_dtype": "topk2",
            "geo.outer_density": 0.05,
            "train.batch_size": 8,
            "train.seq_len": 32,
        },
    ),
    (
        "emulated-2dc",
        4,
        {
            "parallel.nproc": 4,
            "parallel.dp_replicate": 2,
            "parallel.dp_shard": 1,
            "parallel.pp": 2,
            "parallel.pp_schedule": "gpipe",
            "parallel.microbatches": 2,
            "geo.datacenters": 2,
            "geo.dc_axis": "pp",
            "geo.wan_schedule": "time_shared",
            "geo.wan_streams": 4,
            "geo.pp_compression": "lowrank",
            "geo.pp_compression_rank": 8,
            "train.batch_size": 8,
            "train.seq_len": 32,
        },
    ),
    (
        "emulated-2dc",
        4,
        {
            "parallel.nproc": 4,
            "parallel.dp_replicate": 2,
            "parallel.pp": 2,
            "parallel.microbatches": 4,
            "geo.datacenters": 2,
            "geo.dc_axis": "pp",
            "geo.pp_early_recv": True,
            "geo.pp_compression": "int8",
            "train.batch_size": 8,
            "train.seq_len": 32,
        },
    ),
]


def _config(values: dict[str, Any]) -> JobConfig:
    cfg = JobConfig()
    for key, value in values.items():
        set_value(cfg, key, value, from_cli=False)
    validate(cfg)
    return cfg


NOT_LAYOUT = {
    "parallel": {"nproc", "backend", "max_restarts", "timeout_s", "plan", "plan_topology"},
    "geo": {
        "wan_dtype",
        "block_size",
        "error_feedback",
        "feedback_decay",
        "bucket_mb",
        "outer_lr",
        "outer_momentum",
        "mix_alpha",
        "eager",
        "fault_tolerant",
    },
    "train": set(section_fields(JobConfig())["train"]) - {"grad_accum"},
}
"""The config keys that are not the layout's: the world size (``nproc``: ``LayoutSpec.world``), how
a run launches, restarts and plans, how a geo sync runs (not where), and of ``[train]`` all but
gradient accumulation. A new ``[parallel]`` or ``[geo]`` key goes into ``LayoutSpec`` or here."""


def test_the_layout_fields_are_declared_once_in_the_config_and_once_in_layout_spec() -> None:
    keys = section_fields(JobConfig())
    in_spec = {key for f in dataclasses.fields(LayoutSpec) if (key := LayoutSpec.config_key(f.name))}
    for section, not_layout in NOT_LAYOUT.items():
        config_side = {f"{section}.{k}" for k in keys[section]} - {f"{section}.{k}" for k in not_layout}
        spec_side = {k for k in in_spec if k.startswith(f"{section}.")}
        assert config_side - spec_side == set(), f"config keys of the layout missing from LayoutSpec: {section}"
        assert spec_side - config_side == set(), f"LayoutSpec fields that are no {section} key"
    assert in_spec <= {f"{s}.{k}" for s in NOT_LAYOUT for k in keys[s]}
    assert DERIVED == ("micro_batch",)
    assert set(PARALLEL_KEYS) | set(GEO_KEYS) | {"grad_accum"} | set(DERIVED) == {
        f.name for f in dataclasses.fields(LayoutSpec)
    }
    # The words a key takes are the config's (LayoutSpec's dc_axis adds 'none', one datacenter).
    spec_hints = typing.get_type_hints(LayoutSpec)
    for key in in_spec:
        section, name = key.split(".")
        config_hint = typing.get_type_hints(type(getattr(JobConfig(), section)))[name]
        if typing.get_origin(config_hint) is typing.Literal:
            assert set(typing.get_args(config_hint)) <= set(typing.get_args(spec_hints[name])), key
        else:
            assert config_hint is spec_hints[name], key


def test_the_trainer_the_api_and_the_planner_build_from_layout_spec() -> None:
    from isthmus import api
    from isthmus.layout.dims import ParallelDims
    from isthmus.planner.search import SearchSpace
    from isthmus.train import trainer

    # The trainer's log line and checkpoint manifest are the spec's: it keeps no record of its own.
    source = inspect.getsource(trainer)
    assert "LayoutSpec.from_config(cfg)" in source and "def _layout" not in source
    # The API: degrees alone are the layout with every other key at the config's default.
    cfg = _config({"parallel.nproc": 8, "parallel.dp_replicate": 2, "parallel.dp_shard": 2, "parallel.tp": 2})
    assert api._spec_of(ParallelDims(2, 2, 1, 2, 1, 8)) == LayoutSpec.from_config(cfg)
    # The planner: every keyed field is a flag of `isthmus plan` (and so `simulate`) named as its
    # key, and what the search keeps (sequence_parallel it takes wherever tp > 1).
    parser = ArgumentParser(prog="isthmus")
    flags = set(plan_cli.add_parser(parser.add_subparsers())._option_string_actions)
    named = {f.name for f in dataclasses.fields(LayoutSpec) if LayoutSpec.config_key(f.name)} - {"sequence_parallel"}
    assert {f"--{LayoutSpec.config_key(n)}" for n in named} <= flags
    single = {n: getattr(LayoutSpec(), n) for n in named if n not in ("sync", "wan_schedule")}
    assert SearchSpace(single).fixed == single


def test_the_cases_cover_every_field() -> None:
    default = LayoutSpec()
    changed = {
        f.name
        for _, _, values in CASES
        for f in dataclasses.fields(LayoutSpec)
        if getattr(LayoutSpec.from_config(_config(values)), f.name) != getattr(default, f.name)
    }
    assert changed == {f.name for f in dataclasses.fields(LayoutSpec)}


@pytest.mark.parametrize(("topology", "devices", "values"), CASES)
def test_config_spec_planner_spec_config(topology: str, devices: int, values: dict[str, Any]) -> None:
    cfg = _config(values)
    spec = LayoutSpec.from_config(cfg)
    # One name, one meaning: a field named after a config key holds that key's value (no hidden
    # datacenter factor; the derived totals are properties: replicas, dp, world).
    for key in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "zero_stage", "datacenters", "inner_steps"):
        section = "geo" if key in GEO_KEYS else "parallel"
        assert getattr(spec, key) == getattr(getattr(cfg, section), key), key
    assert spec.world == cfg.parallel.nproc
    topo = load_topology(topology)
    if topo.n_devices != devices:
        topo = topo.subset(devices)
    est = estimate(Workload(ARGS, cfg.train.batch_size, cfg.train.seq_len), topo, spec, RUNTIMES["isthmus"])
    assert est.layout == spec and est.work.batch_size == cfg.train.batch_size
    back = LayoutSpec.from_dict(json.loads(json.dumps(est.as_json()["layout"])))
    assert back == spec
    planned = json.loads(json.dumps(est.as_json()))
    again = JobConfig()
    for section in ("parallel", "geo", "train", "model"):
        for key, value in planned[section].items():
            set_value(again, f"{section}.{key}", value, from_cli=False)
    # Beside the layout's keys, the train keys say what it was planned for: sequence length,
    # precision and compilation.
    planned_for = ("seq_len", "dtype", "compile")
    assert {
        f"{s}.{k}": v for s in ("parallel", "geo", "train") for k, v in planned[s].items() if k not in planned_for
    } == back.config_overrides()
    assert (planned["train"]["dtype"], planned["train"]["compile"]) == ("bf16", False)
    validate(again)
    for key, value in values.items():
        section, name = key.split(".")
        assert getattr(getattr(again, section), name) == value, key
    assert LayoutSpec.from_config(again) == spec


def test_the_plan_json_speaks_config_keys(capsys: pytest.CaptureFixture[str]) -> None:
    parser = ArgumentParser(prog="isthmus")
    sub = parser.add_subparsers(dest="command", parser_class=ArgumentParser)
    plan_cli.add_parser(sub)
    argv = [
        "plan",
        "--model.flavor",
        "tiny",
        "--topology",
        "emulated-2dc",
        "--train.batch_size",
        "8",
        "--train.seq_len",
        "32",
        "--top",
        "5",
        "--json",
    ]
    assert plan_cli.run(parser.parse_args(argv)) == 0
    out = json.loads(capsys.readouterr().out)
    keys = section_fields(JobConfig())
    for lay in out["layouts"]:
        for name in lay["layout"]:
            key = LayoutSpec.config_key(name)
            assert name in DERIVED if key is None else key.split(".")[1] in keys[key.split(".")[0]], name
        for section in ("parallel", "geo", "train", "model"):
            assert set(lay[section]) <= set(keys[section]), section
        assert LayoutSpec.from_dict(lay["layout"]).label() == lay["label"]


def test_one_rule_for_the_runtime_and_the_search() -> None:
    why = rules.pipeline_schedule("1f1b", 4, 3, 1)
    assert why is not None and why.key == "parallel.microbatches" and why == "1f1b needs >= pp = 4 micro-batches"
    assert rules.shard_degree(1, 2, 2, 1) == 2 and rules.shard_degree(1, 2, 1, 1) == 1
    assert rules.data_parallel_kind(1, 2, 1, 1, 1, 3) == "ddp" and rules.data_parallel_kind(2, 1, 1, 1, 1, 1) == "zero1"


MANIFEST_KEYS = {
    *("summary", "world_size", "dp_replicate", "dp_shard", "zero_stage", "tp", "sequence_parallel", "cp", "ep"),
    *("cp_impl", "pp", "pp_schedule", "pp_virtual_stages", "microbatches", "datacenters", "dc_axis", "sync"),
}
"""What a checkpoint's manifest records of its layout, as earlier versions wrote it: a run resumed
under an equal layout restores each rank's RNG (and a geo run its geo state)."""


@pytest.mark.parametrize(("topology", "devices", "values"), CASES)
def test_the_manifest_records_what_decides_each_ranks_state(
    topology: str, devices: int, values: dict[str, Any]
) -> None:
    cfg = _config(values)
    manifest = LayoutSpec.from_config(cfg).manifest(cfg.parallel.nproc)
    assert set(manifest) == MANIFEST_KEYS
    for key in MANIFEST_KEYS - {"summary", "world_size"}:
        section = "geo" if key in GEO_KEYS else "parallel"
        assert manifest[key] == getattr(getattr(cfg, section), key), key
    assert manifest["summary"] == LayoutSpec.from_config(cfg).describe()


def test_a_manifest_saved_under_the_old_key_reads_under_the_config_name(tmp_path: Path) -> None:
    from isthmus.checkpoint.manifest import DCP_METADATA_FILE, Manifest, read_manifest, write_manifest

    (tmp_path / DCP_METADATA_FILE).write_bytes(b"")
    layout = {"summary": "dp2/dc diloco", "world_size": 2, "datacenters": 2, "geo_sync": "diloco"}
    write_manifest(tmp_path, Manifest(3, {}, layout, "", {}, {}))
    got = read_manifest(tmp_path).layout
    assert got["sync"] == "diloco" and "geo_sync" not in got
    assert set(LayoutSpec().manifest(1)) >= set(got)  # every key a manifest has is a current one
