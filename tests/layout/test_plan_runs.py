"""A planned layout runs as planned: ``isthmus plan --json > plan.json`` then
``isthmus train --parallel.plan plan.json``, a two-datacenter (geo) plan included, on local gloo ranks."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from isthmus.config import build_config
from isthmus.errors import ConfigError
from isthmus.layout.plan import PLANNED_KEYS, plan_overrides_of
from isthmus.layout.spec import LayoutSpec
from procs import run_isthmus, tiny_run

PLAN = [
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


@pytest.mark.slow
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


def test_a_plan_cannot_choose_where_files_go(tmp_path: Path) -> None:
    """A plan is data someone else may have written: one that names another run's folder and asks to
    overwrite it is refused in one line before anything is touched, and that run keeps its files."""
    other = tmp_path / "other"
    kept = {"checkpoints/step-000002/isthmus.json": "{}", "final/model.pt": "weights", "metrics.jsonl": '{"step": 2}\n'}
    for name, text in kept.items():
        (other / name).parent.mkdir(parents=True, exist_ok=True)
        (other / name).write_text(text)
    plan = tmp_path / "plan.json"
    hostile = {"parallel": {"nproc": 1}, "train": {"run_dir": str(other), "overwrite": True}}
    plan.write_text(json.dumps({"layouts": [hostile]}))
    done = run_isthmus("train", *tiny_run(2), "--parallel.plan", str(plan), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines() == [
        f"isthmus: error: parallel.plan = {str(plan)!r}: sets train.overwrite and train.run_dir, which a plan may "
        "not set (a plan sets the layout, its batch and precision, never where files go or what is replaced)"
    ]
    assert {str(p.relative_to(other)): p.read_text() for p in other.rglob("*") if p.is_file()} == kept
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "key", ["train.run_dir", "train.overwrite", "model.init_from", "parallel.plan", "parallel.plan_topology"]
)
def test_no_key_a_plan_may_set_names_a_path_or_destroys(key: str) -> None:
    """Every key of the plan's sections that names a path or replaces a run (the other sections,
    checkpoint, data and metrics among them, are not read from a plan at all)."""
    assert key not in PLANNED_KEYS
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=f"sets {key}, which a plan may not set"):
        plan_overrides_of({"layouts": [{"parallel": {"nproc": 1}, section: {name: "x"}}]})


def test_every_key_the_planner_writes_is_one_a_plan_may_set(plan_file: Path) -> None:
    best = json.loads(plan_file.read_text())["layouts"][0]
    written = {f"{s}.{k}" for s in ("parallel", "geo", "train", "model") for k in best.get(s, {})}
    assert written and written <= PLANNED_KEYS
