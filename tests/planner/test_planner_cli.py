"""`isthmus plan` through its parser (the CLI's one-line-error parser class) and its run."""

from __future__ import annotations

import json
import re

import pytest

from isthmus.cli import plan as plan_cli
from isthmus.cli.common import ArgumentParser
from isthmus.errors import IsthmusError


def plan(argv: list[str]) -> int:
    parser = ArgumentParser(prog="isthmus")
    sub = parser.add_subparsers(dest="command", parser_class=ArgumentParser)
    plan_cli.add_parser(sub)
    return plan_cli.run(parser.parse_args(["plan", *argv]))


def test_json_has_the_documented_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        plan(
            [
                "--model.flavor",
                "small",
                "--topology",
                "local",
                "--train.batch_size",
                "16",
                "--train.seq_len",
                "128",
                "--top",
                "2",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert len(out["layouts"]) == 2 and out["topology"] == "local"
    for lay in out["layouts"]:
        assert {
            "layout",
            "step_time_s",
            "tokens_per_s",
            "tflops_per_device",
            "mfu",
            "mem_per_device_gb",
            "bubble_fraction",
            "wan_bytes_per_step",
        } <= set(lay)
        assert lay["parallel"]["nproc"] == 2
    assert out["explanation"].startswith("3.")


def test_table_and_explanation(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--model.flavor",
        "gpt3-1.7b",
        "--topology",
        "selene-a100",
        "--gpus",
        "32",
        "--train.batch_size",
        "512",
        "--train.seq_len",
        "2048",
        "--micro-batch",
        "1",
        "--top",
        "3",
    ]
    assert plan(argv) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("#"))
    for col in ("step s", "tokens/s", "TFLOP/s/dev", "MFU", "mem GB", "bubble", "WAN GB/step", "bottleneck"):
        assert col in header
    assert "runs best as" in out and out.count("\n1  ") == 1


def test_model_overrides_reach_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    plan(
        [
            "--model.flavor",
            "gpt3-1.7b",
            "--model.n_layers",
            "4",
            "--topology",
            "local",
            "--train.batch_size",
            "4",
            "--train.seq_len",
            "256",
            "--json",
            "--top",
            "1",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert out["model_params"] < 500_000_000


_H100X8 = ["--model.flavor", "llama3-8b", "--topology", "grand-teton-h100", "--gpus", "8", "--train.seq_len", "4096"]


def test_train_dtype_and_compile_are_planned_and_carried_in_the_json(capsys: pytest.CaptureFixture[str]) -> None:
    """--train.dtype and --train.compile: the names `isthmus train` gives them; the plan's train keys
    carry both, so `--parallel.plan plan.json` trains as planned."""
    base = ["--model.flavor", "small", "--topology", "local", "--train.batch_size", "16", "--train.seq_len", "128"]
    base += ["--parallel.dp_shard", "1", "--top", "1", "--json"]
    planned = {}
    for compiled in ("false", "true"):
        assert plan([*base, "--train.dtype", "bf16", "--train.compile", compiled]) == 0
        best = json.loads(capsys.readouterr().out)["layouts"][0]
        assert best["train"]["dtype"] == "bf16" and best["train"]["compile"] is (compiled == "true")
        assert best["runtime"] == ("isthmus+compile" if compiled == "true" else "isthmus")
        planned[compiled] = best
    # Priced as eager blocks (Runtime.with_compile says why): the same layout and figures.
    assert planned["true"]["layout"] == planned["false"]["layout"]
    assert planned["true"]["mem_per_device_gb"] == planned["false"]["mem_per_device_gb"]
    assert planned["true"]["step_time_s"] == planned["false"]["step_time_s"]
    # A precision isthmus does not train in is priced but not written as a train key.
    assert plan([*base, "--train.dtype", "fp16"]) == 0
    assert "dtype" not in json.loads(capsys.readouterr().out)["layouts"][0]["train"]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--model.flavor", "small", "--train.batch_size", "0"], "--train.batch_size = 0: must be at least 1"),
        (["--model.flavor", "small", "--geo.sync", "flat,warp"], "--geo.sync = 'warp'"),
        (
            ["--model.flavor", "small", "--topology", "nowhere.toml"],
            "--topology = 'nowhere.toml': no such file or preset",
        ),
        (["--model.flavor", "small", "--model.n_heads", "5"], "model.n_heads = 5"),
        (["--model.flavor", "nope"], "model.flavor = 'nope'"),
        (["--model.flavor", "small", "--parallel.activation_checkpoint", "most"], "invalid choice"),
        (["--model.flavor", "small", "--gpus", "3"], "--gpus = 3"),
        # A fixed value that rules out every layout is named, not only "no layout is valid".
        ([*_H100X8, "--parallel.pp", "3"], "--parallel.pp = 3: no valid layout of this 8.03B-parameter model"),
        ([*_H100X8, "--parallel.dp_shard", "3"], "--parallel.dp_shard = 3: no valid layout"),
        (
            [*_H100X8, "--train.batch_size", "16", "--micro-batch", "5"],
            "valid with --micro-batch 5, --train.batch_size 16",
        ),
    ],
)
def test_bad_flags_are_one_line_errors(argv: list[str], needle: str) -> None:
    with pytest.raises(IsthmusError) as info:
        plan(argv)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_a_reader_that_leaves_early_ends_the_command_quietly(tmp_path) -> None:
    """`isthmus plan ... | true`: the reader is gone before the plan (a second of search) is written; no
    BrokenPipeError traceback, the SIGPIPE exit code (141)."""
    import subprocess
    import sys

    cmd = (
        f"{sys.executable} -m isthmus plan --model.flavor gpt3-145.6b --topology selene-a100 --train.batch_size 1536"
        " --train.seq_len 2048 --top 3 | true"
    )
    proc = subprocess.run(
        ["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.stderr == "", proc.stderr
    assert proc.returncode == 141, proc.returncode


def test_a_pinned_layout_over_memory_shows_its_own_peak() -> None:
    """Pinning dp_shard leaves cores it cannot divide; they have no variant and are not "over memory",
    so the closest refused device is the pinned layout's own, above the limit (it once showed an
    unsharded floor of 65.8 GB "of 91.2 GB usable")."""
    argv = ["--model.flavor", "llama3-8b", "--topology", "grand-teton-h100", "--gpus", "8", "--train.batch_size", "96"]
    argv += ["--train.seq_len", "8192", "--micro-batch", "4", "--train.dtype", "bf16"]
    argv += ["--parallel.activation_checkpoint", "selective", "--parallel.tp", "1", "--parallel.pp", "1"]
    argv += ["--parallel.dp_shard", "8", "--parallel.zero_stage", "3"]
    with pytest.raises(IsthmusError) as info:
        plan(argv)
    message = str(info.value)
    assert "1 considered, 1 over memory" in message and "\n" not in message
    closest, usable = (float(x) for x in re.search(r"= ([\d.]+) GB of ([\d.]+) GB usable", message).groups())  # type: ignore[union-attr]
    assert closest > usable


def test_legend_prints_every_label_part_and_needs_no_model(capsys: pytest.CaptureFixture[str]) -> None:
    from isthmus.layout.spec import LABEL_LEGEND

    with pytest.raises(SystemExit) as done:
        plan(["--legend"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert all(f"  {part.token} " in out for part in LABEL_LEGEND)


_ATLAS = ["--model.flavor", "llama3-70b", "--topology", "examples/atlas-3dc.toml", "--train.batch_size", "128"]


def test_layouts_that_run_come_first_and_the_what_ifs_apart(capsys: pytest.CaptureFixture[str]) -> None:
    """On Atlas's three datacenters the fastest layouts are what-ifs (two of the three, unequal
    stages): the table lists the layouts the runtime runs, then the what-ifs under their own line."""
    assert plan([*_ATLAS, "--train.seq_len", "2048", "--top", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.lstrip().startswith("1  "))
    label = next(i for i, line in enumerate(lines) if line.startswith("planner-only what-ifs"))
    what_if = next(i for i, line in enumerate(lines) if line.startswith("w1  "))
    assert first < label < what_if and "(uses 2 of the 3 datacenters" in lines[what_if]
    assert any(line.startswith("labels: tpN tensor parallel;") for line in lines)


_TWO_DCS = ["--model.flavor", "tiny", "--topology", "emulated-2dc", "--train.batch_size", "8", "--train.seq_len", "32"]
_DILOCO = ["--geo.datacenters", "2", "--geo.dc_axis", "dp", "--geo.sync", "diloco,streaming_diloco", "--json"]


def test_a_short_run_syncs_at_least_min_syncs_times(capsys: pytest.CaptureFixture[str]) -> None:
    from isthmus.layout.syncs import MIN_SYNCS

    assert plan([*_TWO_DCS, *_DILOCO, "--train.steps", "10"]) == 0
    out = json.loads(capsys.readouterr().out)
    for lay in out["layouts"]:
        geo = lay["geo"]
        assert geo["inner_steps"] * MIN_SYNCS <= 10 and geo["fragments"] <= geo["inner_steps"]
        assert geo["overlap_steps"] < geo["inner_steps"]
    assert out["sync_note"] is None
    # A fixed interval is kept, and the plan says why it is too long for the run.
    assert plan([*_TWO_DCS, *_DILOCO, "--train.steps", "10", "--geo.inner_steps", "100"]) == 0
    note = json.loads(capsys.readouterr().out)["sync_note"]
    assert note.startswith("warning: geo.inner_steps = 100 syncs the datacenters 0 time(s) in train.steps = 10")
    # Without a run length the interval is the planner's, with the length it needs.
    assert plan([*_TWO_DCS, *_DILOCO]) == 0
    assert "give --train.steps N" in json.loads(capsys.readouterr().out)["sync_note"]
