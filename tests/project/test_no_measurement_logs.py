"""Comments in src/ say why, not what was measured when: figures live in docs/benchmarks.md and dev/LOG.md.

A comment or docstring may name a figure that explains a choice, pointing to the page or the log; what
it may not hold is a lab note: a date, a clock time, a machine's load, or "measured ..." followed by
the figure it read. Python comments and docstrings and the shipped TOML files' comments are read; string
literals that are code (messages, keys) are not.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "isthmus"

UNIT = r"(?:ms|us|µs|s|KiB|MiB|GiB|KB|MB|GB|GB/s|Mbit/s|Gbit/s|GFLOP/s|TFLOP/s|tok/s|tokens/s|%|x)"
SENTENCE = r"(?:(?!\.\s)[^;])*?"  # up to the end of the sentence (a decimal point does not end it)
LAB_NOTES = {
    "a date": re.compile(r"(?<![\w-])20\d\d-[01]\d-[0-3]\d(?![\w-])"),
    "a clock time": re.compile(r"\b[0-2]?\d:[0-5]\d(?::\d\d)? ?UTC\b"),
    "a machine's load": re.compile(r"\bload average\b", re.IGNORECASE),
    "where it was measured": re.compile(
        r"(?<![\w-])(?:measured|timed|profiled)\s+(?:here|today|on this (?:machine|project))"
        r"|(?<![\w-])(?:measured|checked|timed)\s+(?:on|with) torch \d",
        re.IGNORECASE,
    ),
    "a measured figure": re.compile(
        rf"(?<![\w-])measured\b{SENTENCE}(?<![\w.])\d[\d,.]*\s?{UNIT}(?![\w/])", re.IGNORECASE | re.DOTALL
    ),
}


def python_notes(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of every comment block and docstring of a Python file."""
    source = path.read_text()
    notes: list[tuple[int, str]] = []
    block: list[str] = []
    start = last = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            if block and tok.start[0] == last + 1:
                block.append(tok.string.lstrip("# "))
            else:
                if block:
                    notes.append((start, " ".join(block)))
                block, start = [tok.string.lstrip("# ")], tok.start[0]
            last = tok.start[0]
    if block:
        notes.append((start, " ".join(block)))
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)  # a lambda's is one expression, no docstrings
        for stmt in body if isinstance(body, list) else []:
            value = stmt.value if isinstance(stmt, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                notes.append((stmt.lineno, " ".join(value.value.split())))
    return notes


def toml_notes(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment line of a TOML file."""
    return [
        (n, line.split("#", 1)[1])
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "#" in line and line.lstrip().startswith("#")
    ]


def lab_notes(notes: list[tuple[int, str]]) -> list[tuple[int, str, str]]:
    """(line, what kind of lab note, the text that is one) for each note that holds one."""
    found = []
    for line, text in notes:
        for what, pattern in LAB_NOTES.items():
            if match := pattern.search(text):
                found.append((line, what, match.group(0)))
    return found


def test_the_patterns_catch_lab_notes_and_pass_reasons() -> None:
    caught = [
        "measured here on `small`'s 3.5M parameters, 9.9 against 148 ms a step",
        "(checked on torch 2.13: a receive whose bytes had arrived still said False after 3 s)",
        "Written by `isthmus profile` on this machine, 2026-12-06 06:16 UTC, in 37 s",
        "One flow with a 64 KiB buffer at 80 ms measured 3.7 Mbit/s in the emulator",
        "(torch fp32 on CPU; 2 cores; load average 1.4 when it ran)",
    ]
    passed = [
        "A chunk's predicted cost is the median of its recent measured costs times this.",
        "the memory bandwidth is set so the planner's block time is the measured one",
        "torch 2.13 deprecates reduce_scatter_tensor for this name; gloo implements it on CPU.",
        "forkserver's socket, which 3.11.0 opened to every local user (CVE-2022-42919).",
        "Size in bytes and sha256 of a file, read in 1 MiB chunks.",
        "a dp_replicate 2 step takes compute + all-reduce (benchmarks/plan_vs_measured.py).",
    ]
    assert all(lab_notes([(1, text)]) for text in caught), [t for t in caught if not lab_notes([(1, t)])]
    assert not lab_notes([(n, text) for n, text in enumerate(passed)]), lab_notes(list(enumerate(passed)))


def test_src_comments_hold_no_dated_measurement_logs() -> None:
    found = [
        f"{path.relative_to(SRC.parent)}:{line}: {what}: {text!r}"
        for path in sorted(SRC.rglob("*"))
        if path.suffix in (".py", ".toml")
        for line, what, text in lab_notes(python_notes(path) if path.suffix == ".py" else toml_notes(path))
    ]
    assert not found, (
        "comments and docstrings say why in a few lines; the figures and when they were measured go to "
        "docs/benchmarks.md or dev/LOG.md:\n" + "\n".join(found)
    )
