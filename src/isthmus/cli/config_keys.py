"""Every config key with its type, default and doc, read from the config dataclasses themselves.

A key is documented once, by the docstring under its field in `isthmus.config` (an attribute
docstring, as Sphinx and mkdocstrings read them); a section by its class docstring. This module
renders them twice: as the key list of ``isthmus train --help`` and as the manual's configuration
reference (``docs/hooks/config_reference.py`` calls :func:`reference_markdown`). Pure Python: the
command line reads it without torch.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal, get_args, get_origin

from isthmus.config import JobConfig


@dataclass(frozen=True)
class ConfigKey:
    """One ``section.key``: what it takes, its default and its doc."""

    section: str
    name: str
    type: str
    default: str
    doc: str

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"


@dataclass(frozen=True)
class ConfigSection:
    name: str
    doc: str
    keys: tuple[ConfigKey, ...]


def attribute_docs(cls: type) -> dict[str, str]:
    """``field -> docstring`` for the string literal under each annotated field of ``cls`` and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0]
        assert isinstance(body, ast.ClassDef)
        for node, after in zip(body.body, body.body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def class_doc(cls: type) -> str:
    """The class's own docstring in one paragraph; "" where only the dataclass's generated signature is."""
    doc = cls.__dict__.get("__doc__") or ""
    if doc.startswith(f"{cls.__name__}("):  # dataclass() writes the signature where no docstring is
        return ""
    return " ".join(inspect.cleandoc(doc).split())


def type_name(tp: Any) -> str:
    """A field's type as a reader writes its value: ``int``, ``true|false``, ``fp32|bf16`` (None, a key
    left unset, shows as its default)."""
    origin = get_origin(tp)
    if origin is Literal:
        return "|".join(str(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return " or ".join(type_name(a) for a in inner)
    return {int: "int", float: "float", bool: "true|false", str: "string"}.get(tp, str(tp))


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is dataclasses.MISSING:
        return ""
    value = f.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


@cache
def config_sections() -> tuple[ConfigSection, ...]:
    """Every section of `JobConfig` and every key in it, in the order the dataclasses declare them."""
    out: list[ConfigSection] = []
    for section in dataclasses.fields(JobConfig):
        cls = section.default_factory
        assert isinstance(cls, type), f"[{section.name}] must be a dataclass built by its default_factory"
        hints = typing.get_type_hints(cls)
        docs = attribute_docs(cls)
        keys = tuple(
            ConfigKey(section.name, f.name, type_name(hints[f.name]), _default(f), docs.get(f.name, ""))
            for f in dataclasses.fields(cls)
        )
        out.append(ConfigSection(section.name, class_doc(cls), keys))
    return tuple(out)


def help_text(width: int = 100) -> str:
    """The key list ``isthmus train --help`` ends with: every key, its type and default, its doc."""
    lines = [
        "config keys, set as --section.key VALUE; a value comes from the defaults shown here, then the",
        "--config file (configs/default.toml unless one is named), then the command line:",
    ]
    for section in config_sections():
        lines += ["", f"[{section.name}]" + (f" {section.doc}" if section.doc else "")]
        for key in section.keys:
            default = f" (default: {key.default})" if key.default else ""
            lines.append(f"  --{key.dotted} {key.type}{default}")
            lines += textwrap.wrap(key.doc, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def reference_markdown() -> str:
    """The configuration reference as Markdown: one table per section, one row per key."""
    out: list[str] = []
    for section in config_sections():
        out += [f"## `[{section.name}]`", ""]
        if section.doc:
            out += [section.doc, ""]
        out += ["| key | type | default | what it does |", "|---|---|---|---|"]
        for key in section.keys:
            # A pipe inside a code span does not split a cell (Python-Markdown's tables); in text it would.
            default = key.default if key.default in ("", "unset") else f"`{key.default}`"
            out.append(f"| `{key.dotted}` | `{key.type}` | {default} | {_cell(key.doc)} |")
        out.append("")
    return "\n".join(out)
