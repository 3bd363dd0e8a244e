"""`isthmus simulate` through the CLI's one-line-error parser class: layouts, JSON, trace, timeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from isthmus.cli import plan as plan_cli
from isthmus.cli import simulate as simulate_cli
from isthmus.cli.common import ArgumentParser
from isthmus.errors import IsthmusError

LOCAL = ["--model.flavor", "small", "--topology", "local", "--train.batch_size", "16", "--train.seq_len", "128"]


def run(command: str, argv: list[str]) -> int:
    parser = ArgumentParser(prog="isthmus")
    sub = parser.add_subparsers(dest="command", parser_class=ArgumentParser)
    plan_cli.add_parser(sub)
    simulate_cli.add_parser(sub)
    ns = parser.parse_args([command, *argv])
    return plan_cli.run(ns) if command == "plan" else simulate_cli.run(ns)


def test_json_has_the_plan_fields_and_no_plan_takes_the_best(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("plan", [*LOCAL, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["layouts"][0]
    assert run("simulate", [*LOCAL, "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert set(planned) <= set(simulated)
    assert simulated["layout"] == planned["layout"] and simulated["parallel"] == planned["parallel"]
    assert simulated["simulated"]["cost_model_step_time_s"] == pytest.approx(planned["step_time_s"])
    assert simulated["step_time_s"] == pytest.approx(planned["step_time_s"], rel=0.03)


def test_the_layout_flags_fix_what_they_name(capsys: pytest.CaptureFixture[str]) -> None:
    plan = ["--parallel.pp", "2", "--parallel.pp_schedule", "interleaved_1f1b", "--parallel.pp_virtual_stages", "2"]
    assert run("simulate", [*LOCAL, *plan, "--parallel.microbatches", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    par = out["parallel"]
    assert (par["pp"], par["pp_schedule"], par["pp_virtual_stages"], par["microbatches"]) == (
        2,
        "interleaved_1f1b",
        2,
        4,
    )
    assert run("simulate", [*LOCAL, "--parallel.tp", "2", "--parallel.sequence_parallel", "false", "--json"]) == 0
    par = json.loads(capsys.readouterr().out)["parallel"]
    assert par["tp"] == 2 and par["sequence_parallel"] is False
    assert run("simulate", [*LOCAL, "--train.grad_accum", "2", "--parallel.dp_replicate", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["train"]["grad_accum"], out["parallel"]["microbatches"], out["parallel"]["dp_replicate"]) == (2, 1, 2)
    assert out["layout"]["grad_accum"] == 2 and out["label"].endswith("x2")


def test_table_trace_and_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    argv = [
        *LOCAL,
        *("--parallel.pp", "2", "--parallel.pp_schedule", "1f1b", "--parallel.microbatches", "4"),
        "--iterations",
        "2",
        "--trace",
        str(trace),
        "--png",
        str(png),
    ]
    assert run("simulate", argv) == 0
    out = capsys.readouterr().out
    for word in ("step time", "tokens/s", "bubble", "simulated", "cost model", "trace:", "timeline:"):
        assert word in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" and e["name"].startswith("F mb") for e in events) == 2 * 2 * 4
    assert png.stat().st_size > 1000


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--parallel.bogus", "1"], "unrecognized arguments: --parallel.bogus"),
        (["--parallel.tp", "two"], "argument --parallel.tp: invalid int value: 'two'"),
        (["--parallel.pp_schedule", "warp"], "argument --parallel.pp_schedule: invalid choice: 'warp'"),
        (["--parallel.sequence_parallel", "maybe"], "expected true or false"),
        (["--parallel.tp", "0"], "--parallel.tp = 0: must be at least 1"),
        (["--parallel.tp", "3"], "--parallel.tp = 3: no valid layout"),
        (["--parallel.tp", "1", "--parallel.sequence_parallel", "true"], "--parallel.sequence_parallel True together"),
        (["--plan", "tp=2"], "--plan = 'tp=2': is given by the layout flags now"),
    ],
)
def test_bad_layout_flags_are_one_line_errors(flags: list[str], needle: str) -> None:
    with pytest.raises(IsthmusError) as info:
        run("simulate", [*LOCAL, *flags, "--parallel.pp", "1"])
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_bad_iterations() -> None:
    with pytest.raises(IsthmusError, match="--iterations = 0: must be at least 1"):
        run("simulate", [*LOCAL, "--iterations", "0"])
