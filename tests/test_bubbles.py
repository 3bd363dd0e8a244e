"""Bubble filling (``bubbles.prefill``): prefill requests served in a pipeline's waits.

Two real runs of the same 2-rank pipeline on gloo, without and with filling: the losses, gradient
norms and final weights must be equal exactly (the filler runs a separate frozen model, draws no
random numbers, touches no training state). Every request's output must equal the same prefill run
alone (same function, no training around it), and the timeline must show filler chunks inside the
waits they filled. Bad settings end in one line, exit 2, before any rank starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from isthmus.cli import main
from isthmus.train.bubbles import prefill_alone

# The trained model is wider than `tiny`, so that its stages leave each other waits of several
# milliseconds; the requests are served by `tiny` (short prompts, well under a millisecond each).
LAYOUT = ("--parallel.pp", "2", "--parallel.microbatches", "4", "--model.dim", "256", "--model.ffn_dim", "512")
BUBBLES = ("--bubbles.prefill", "synthetic:400:4", "--bubbles.model", "tiny")


def _train(tmp: Path, name: str, *flags: str) -> tuple[list[tuple[float, float]], Path]:
    run_dir = tmp / name
    argv = [
        "train",
        "--config",
        "tiny",
        "--parallel.nproc",
        "2",
        "--train.steps",
        "6",
        "--train.val_every",
        "0",
        "--data.max_bytes",
        "200000",
        "--train.run_dir",
        str(run_dir),
        "--metrics.progress",
        "false",
        "--train.threads",
        "1",
        *LAYOUT,
        *flags,
    ]
    assert main(argv) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in records if "loss" in r], run_dir


@pytest.mark.slow
def test_filling_changes_no_training_value_and_serves_every_request(tmp_path: Path) -> None:
    plain, plain_dir = _train(tmp_path, "plain")
    trace = tmp_path / "trace.json"
    filled, filled_dir = _train(tmp_path, "filled", *BUBBLES, "--metrics.timeline", str(trace))
    assert len(plain) == 6 and filled == plain
    a = torch.load(plain_dir / "final" / "model.pt", weights_only=True)
    b = torch.load(filled_dir / "final" / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    served = [json.loads(line) for line in (filled_dir / "prefill.jsonl").read_text().splitlines()]
    alone = prefill_alone(filled_dir)  # the run's own config and tokenizer, one thread as its ranks
    assert sorted(r["id"] for r in served) == sorted(alone)
    for r in served:
        assert (r["next_token"], r["logits_sha256"]) == (alone[r["id"]]["next_token"], alone[r["id"]]["logits_sha256"])
    in_bubbles = [r for r in served if r["step"] is not None]
    assert in_bubbles and {r["rank"] for r in in_bubbles} <= {0, 1}

    # Every filler chunk on the timeline lies inside a wait of its own rank, and there is one per
    # request served in a bubble.
    events = json.loads(trace.read_text())["traceEvents"]
    chunks = [e for e in events if e.get("cat") == "prefill"]
    waits = [e for e in events if e.get("cat") == "wait"]
    assert len(chunks) == len(in_bubbles)
    for c in chunks:
        assert any(
            w["pid"] == c["pid"] and w["ts"] <= c["ts"] and c["ts"] + c["dur"] <= w["ts"] + w["dur"] for w in waits
        ), c
    assert {e.get("cat") for e in events} >= {"forward", "backward", "optimizer", "wait", "prefill", "step"}
    metrics = [json.loads(line) for line in (filled_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "loss" in m]
    assert all(len(m["busy"]) == 2 and all(0 < x <= 1 for x in m["busy"]) for m in steps)
    assert sum(m["prefill_tokens"] for m in steps) == 4 * len(in_bubbles)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("--bubbles.prefill", "synthetic:0:4"), "bubbles.prefill = 'synthetic:0:4': synthetic:N:LEN needs two"),
        (("--bubbles.prefill", "nowhere.jsonl"), "bubbles.prefill = 'nowhere.jsonl': no such file"),
        (("--parallel.pp", "1", "--bubbles.prefill", "synthetic:2:4"), "needs parallel.pp > 1"),
        (("--bubbles.prefill", "synthetic:2:4", "--bubbles.model", "huge"), "bubbles.model = 'huge': must be empty or"),
        (("--bubbles.prefill", "{bad}"), '.jsonl:2: "tokens" must be a non-empty list of token ids in [0, 256)'),
        (
            ("--bubbles.prefill", "synthetic:2:4", "--geo.datacenters", "2", "--geo.dc_axis", "pp")
            + ("--geo.wan_schedule", "time_shared"),
            "cannot be combined with geo.wan_schedule = time_shared",
        ),
    ],
)
def test_bad_bubbles_settings_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], expected: str
) -> None:
    bad = tmp_path / "requests.jsonl"
    bad.write_text('{"id": 1, "prompt": "hello"}\n{"id": 2, "tokens": [1, 999]}\n')
    flags = tuple(str(bad) if f == "{bad}" else f for f in flags)
    base = ["train", "--config", "tiny", "--parallel.nproc", "2", "--parallel.pp", "2", "--parallel.microbatches", "2"]
    assert main([*base, *flags, "--train.run_dir", str(tmp_path / "run")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("isthmus: error: ") and expected in lines[0], lines
    assert not (tmp_path / "run").exists()
