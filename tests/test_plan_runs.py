"""A planned layout runs as planned: ``isthmus plan --json > plan.json`` then
``isthmus train --parallel.plan plan.json``, a two-datacenter (geo) plan included, on local gloo ranks."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from isthmus.config import build_config
from isthmus.errors import ConfigError
from isthmus.layout.spec import LayoutSpec
from procs import run_isthmus

PLAN = [
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
    "3",
    "--json",
]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    here = tmp_path_factory.mktemp("plan")
    done = run_isthmus(*PLAN, cwd=here)
    assert done.returncode == 0, done.stderr[-3000:]
    path = here / "plan.json"
    path.write_text(done.stdout)
    return path


def test_a_two_datacenter_plan_trains_locally(plan_file: Path, tmp_path: Path) -> None:
    best = json.loads(plan_file.read_text())["layouts"][0]
    assert best["geo"]["datacenters"] == 2 and best["geo"]["dc_axis"] == "dp" and best["geo"]["sync"] != "none"
    run = tmp_path / "run"
    done = run_isthmus(
        "train",
        "--config",
        "tiny",
        "--parallel.plan",
        str(plan_file),
        "--train.run_dir",
        str(run),
        "--data.max_bytes",
        "60000",
        "--train.val_every",
        "0",
        "--metrics.progress",
        "false",
        cwd=tmp_path,
        env={"ISTHMUS_MAX_STEPS": "2"},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ran = tomllib.loads((run / "config.toml").read_text())
    for section in ("parallel", "geo", "train"):
        for key, value in best[section].items():
            assert ran[section][key] == value, f"{section}.{key}: planned {value!r}, ran {ran[section][key]!r}"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("step") == 2 for r in steps)


def test_the_command_line_wins_over_the_plan(plan_file: Path) -> None:
    cfg = build_config(None, [("parallel.plan", str(plan_file)), ("geo.inner_steps", "7"), ("geo.fragments", "1")])
    best = json.loads(plan_file.read_text())["layouts"][0]
    assert cfg.geo.inner_steps == 7 and cfg.geo.sync == best["geo"]["sync"]
    assert cfg.parallel.nproc == best["parallel"]["nproc"] and cfg.parallel.plan == "manual"
    spec = LayoutSpec.from_config(cfg)
    assert spec.with_(
        inner_steps=best["layout"]["inner_steps"], fragments=best["layout"]["fragments"]
    ) == LayoutSpec.from_dict(best["layout"])


def test_a_plan_that_breaks_a_rule_names_the_key(plan_file: Path) -> None:
    from isthmus.cli.train import train_config

    with pytest.raises(ConfigError, match="parallel.nproc = 3"):
        train_config("tiny", ["--parallel.plan", str(plan_file), "--parallel.nproc", "3"])
    with pytest.raises(ConfigError, match="parallel.plan = 'nowhere.json'"):
        build_config(None, [("parallel.plan", "nowhere.json")])
