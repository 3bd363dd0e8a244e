"""Bubble filling (``bubbles.prefill``): prefill requests served in a pipeline's waits.

Two real runs of the same 2-rank pipeline on gloo, without and with filling: the losses, gradient
norms and final weights must be equal exactly (the filler runs a separate frozen model, draws no
random numbers, touches no training state). Every request's output must equal the same prefill run
alone (same function, no training around it), and the timeline must show filler chunks inside the
waits they filled. Bad settings end in one line, exit 2, before any rank starts.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from isthmus.cli import main
from isthmus.config import JobConfig
from isthmus.data.tokenizer import ByteTokenizer
from isthmus.errors import DataError
from isthmus.serve.prefill import load_requests, prefill_alone
from isthmus.serve.requests import RequestLimits, read_request_file
from procs import last_line, run_isthmus, tiny_run

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
        (
            ("--parallel.pp", "1", "--parallel.microbatches", "1", "--bubbles.prefill", "synthetic:2:4"),
            "needs parallel.pp > 1",
        ),
        (("--bubbles.prefill", "synthetic:2:4", "--bubbles.model", "huge"), "bubbles.model = 'huge': must be empty or"),
        (("--bubbles.prefill", "{bad}"), '.jsonl:2: "tokens" must be a non-empty list of token ids in [0, 256)'),
        (("--bubbles.prefill", "synthetic:2:100"), "LEN = 100 is more than train.seq_len = 64"),
        (("--bubbles.prefill", f"synthetic:{10**12}:1"), "local rank(s) holds every request"),
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


def test_a_request_longer_than_the_model_positions_is_refused_before_any_rank(tmp_path: Path) -> None:
    """Issue 31, case 3: one request of 10^6 tokens under a pp 2 run was accepted and stalled the
    ranks before step 1 (each rank prefilled it several times to time it). It is refused in one
    line naming the file, the line and the limit, before any process starts."""
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps({"id": "big", "tokens": [7] * 10**6}) + "\n")
    layout = ("--parallel.nproc", "2", "--parallel.pp", "2", "--parallel.microbatches", "2")
    start = time.monotonic()
    proc = run_isthmus(
        "train",
        *tiny_run(4),
        *layout,
        "--bubbles.prefill",
        str(big),
        "--train.run_dir",
        str(tmp_path / "run"),
        timeout=90,
    )
    took = time.monotonic() - start
    line = last_line(proc.stderr)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert line.startswith(f"isthmus: error: bubbles.prefill: {big}:1: ") and "train.seq_len = 32" in line, line
    assert not (tmp_path / "run").exists() and took < 60


LIMITS = RequestLimits(max_tokens=32, max_total_tokens=100, total_rule="the test's limit")


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ([b"hello"], ":1: not JSON (Expecting value)"),
        ([b'{"id": 1, "prompt": "a"}', b"[1, 2]"], ':2: needs "id" and one of "prompt"'),
        ([b'{"id": [1], "prompt": "a"}'], ':1: "id" must be a non-empty string or an integer, not [1]'),
        ([b'{"id": true, "prompt": "a"}'], ':1: "id" must be a non-empty string or an integer, not true'),
        ([b'{"id": 1, "prompt": ""}'], ':1: "prompt" must be a non-empty string'),
        ([b'{"id": 1, "prompt": 5}'], ':1: "prompt" must be a non-empty string'),
        ([b'{"id": 1, "tokens": []}'], ':1: "tokens" must be a non-empty list of token ids in [0, 256)'),
        ([b'{"id": 1, "tokens": [1.0]}'], ':1: "tokens" must be a non-empty list'),
        ([b'{"id": 1, "tokens": "12"}'], ':1: "tokens" must be a non-empty list'),
        ([b'{"id": 1, "prompt": "a", "tokens": [1]}'], ':1: needs "id" and one of'),
        ([b'{"id": 1, "prompt": "a"}', b'{"id": "1", "prompt": "b"}'], ":2: id '1' appears twice"),
        (
            [b'{"id": 1, "prompt": "a"}', b'{"id": 2, "prompt": "\xff"}'],
            ":2: not UTF-8 (invalid start byte at byte 21)",
        ),
        (
            [b'{"id": "long", "prompt": "' + b"a" * 40 + b'"}'],
            ":1: request 'long' has 40 tokens, more than train.seq_len = 32",
        ),
        (
            [json.dumps({"id": 9, "tokens": [0] * 33}).encode()],
            ":1: request '9' has 33 tokens, more than train.seq_len = 32",
        ),
        (
            [b'{"id": 1, "prompt": "' + b"a" * 4000 + b'"}'],
            ":1: longer than 3,072 bytes, the most a request of at most",
        ),
        ([b""], " holds no requests"),
        ([b"", b"  ", b""], " holds no requests"),
    ],
)
def test_a_bad_request_file_is_one_line_naming_its_line(tmp_path: Path, lines: list[bytes], expected: str) -> None:
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError) as e:
        read_request_file(path, 256, LIMITS, _utf8_len)
    assert str(e.value).startswith(f"bubbles.prefill: {path}") and expected in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_a_huge_request_file_stops_at_the_line_past_the_limit(tmp_path: Path) -> None:
    """Requests beyond what the ranks have memory for are refused at the line that passes it; the
    rest of the file is not read (nor a line beyond the longest a request may take)."""
    path = tmp_path / "many.jsonl"
    with path.open("w") as f:
        for i in range(2_000):
            f.write(json.dumps({"id": i, "tokens": [1] * 30}) + "\n")
        f.write("x" * 10**6)
    with pytest.raises(DataError, match=r"many.jsonl:4: the requests up to here hold 120 tokens, more than 100: "):
        read_request_file(path, 256, LIMITS, _utf8_len)
    path.write_bytes(b'{"id": 1, "prompt": "a"}\n' + b"x" * 10**7)
    with pytest.raises(DataError, match=r"many.jsonl:2: longer than 3,072 bytes"):
        read_request_file(path, 256, LIMITS, _utf8_len)


def test_a_line_as_long_as_the_limit_is_read(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    head = b'{"id": 1, "prompt": "a"}'
    path.write_bytes(head + b" " * (LIMITS.max_line_bytes - len(head)) + b"\r\n")
    assert [(r.line, r.id, r.prompt) for r in read_request_file(path, 256, LIMITS, _utf8_len)] == [(1, "1", "a")]


def test_a_prompt_is_checked_again_once_a_rank_has_tokenized_it(tmp_path: Path) -> None:
    """Under a BPE the run trains, preflight cannot count a prompt's tokens: the rank does, before
    it times or serves any request."""
    path = tmp_path / "r.jsonl"
    path.write_text('{"id": "ok", "prompt": "abcd"}\n\n{"id": "x", "prompt": "abcdefghi"}\n')
    cfg = JobConfig()
    cfg.train.seq_len, cfg.bubbles.prefill = 8, str(path)
    with pytest.raises(
        DataError, match=rf"^bubbles.prefill: {path}:3: request 'x' has 9 tokens, more than train.seq_len = 8"
    ):
        load_requests(cfg, ByteTokenizer(), 256)
    cfg.train.seq_len = 9
    assert [r.tokens for r in load_requests(cfg, ByteTokenizer(), 256)] == [list(b"abcd"), list(b"abcdefghi")]
