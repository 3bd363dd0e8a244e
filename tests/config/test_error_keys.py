"""Errors name settings that exist: a key like ``parallel.pp_microbatches`` in an error must be a config key."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from isthmus.config import JobConfig, section_fields

SRC = Path(__file__).resolve().parents[2] / "src" / "isthmus"
DOTTED = re.compile(r"^([a-z_]+)\.([a-z_0-9]+)$")


def _named_keys() -> list[tuple[str, int, str]]:
    """(file, line, key) of every dotted string literal passed first to ConfigError(...) in src/."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", None)) == "ConfigError"
            ):
                first = node.args[0] if node.args else None
                if isinstance(first, ast.Constant) and isinstance(first.value, str) and DOTTED.match(first.value):
                    found.append((str(path.relative_to(SRC)), node.lineno, first.value))
    return found


def test_every_config_key_named_in_an_error_exists() -> None:
    fields = section_fields(JobConfig())
    named = _named_keys()
    assert len(named) > 50  # the scan sees the errors (it would pass vacuously otherwise)
    wrong = [
        f"{file}:{line} {key}"
        for file, line, key in named
        if key.split(".")[0] in fields and key.split(".")[1] not in fields[key.split(".")[0]]
    ]
    assert not wrong, wrong
