"""One vocabulary: every `LayoutSpec` field is a config key, round-trips config -> spec -> planner
-> spec -> config unchanged, and `isthmus plan --json` speaks only config keys."""

from __future__ import annotations

import dataclasses
import json
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


def test_every_field_is_a_config_key_or_documented_as_derived() -> None:
    keys = section_fields(JobConfig())
    for f in dataclasses.fields(LayoutSpec):
        assert f.name in keys["parallel"] or f.name in keys["geo"] or f.name in DERIVED, f.name
    assert set(PARALLEL_KEYS) <= set(keys["parallel"]) and set(GEO_KEYS) <= set(keys["geo"])


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
        "--model",
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
        assert set(lay["layout"]) <= set(keys["parallel"]) | set(keys["geo"]) | set(DERIVED)
        for section in ("parallel", "geo", "train", "model"):
            assert set(lay[section]) <= set(keys[section]), section
        assert LayoutSpec.from_dict(lay["layout"]).label() == lay["label"]


def test_one_rule_for_the_runtime_and_the_search() -> None:
    why = rules.pipeline_schedule("1f1b", 4, 3, 1)
    assert why is not None and why.key == "parallel.microbatches" and why == "1f1b needs >= pp = 4 micro-batches"
    assert rules.shard_degree(1, 2, 2, 1) == 2 and rules.shard_degree(1, 2, 1, 1) == 1
    assert rules.data_parallel_kind(1, 2, 1, 1, 1, 3) == "ddp" and rules.data_parallel_kind(2, 1, 1, 1, 1, 1) == "zero1"


@pytest.mark.parametrize(("topology", "devices", "values"), CASES)
def test_the_manifest_form_is_what_a_checkpoint_records(topology: str, devices: int, values: dict[str, Any]) -> None:
    from isthmus.layout.dims import check_layout
    from isthmus.train import trainer

    cfg = _config(values)
    dims = check_layout(cfg, ARGS.n_heads, ARGS.n_kv_heads, ARGS.n_layers)
    summary = trainer._layout_str(dims, cfg)
    assert LayoutSpec.from_config(cfg).manifest(dims.world_size, summary) == trainer._layout(dims, cfg)


def test_a_manifest_saved_under_the_old_key_reads_under_the_config_name(tmp_path: Path) -> None:
    from isthmus.checkpoint.manifest import DCP_METADATA_FILE, Manifest, read_manifest, write_manifest

    (tmp_path / DCP_METADATA_FILE).write_bytes(b"")
    layout = {"summary": "dp2/dc diloco", "world_size": 2, "datacenters": 2, "geo_sync": "diloco"}
    write_manifest(tmp_path, Manifest(3, {}, layout, "", {}, {}))
    got = read_manifest(tmp_path).layout
    assert got["sync"] == "diloco" and "geo_sync" not in got
    assert set(LayoutSpec().manifest(1, "")) >= set(got)  # every key a manifest has is a current one
