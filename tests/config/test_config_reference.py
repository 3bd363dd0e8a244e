"""Every config key is documented once, by its field's docstring, and shows in `isthmus train --help`
and in the manual's configuration reference, both rendered from that docstring."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from isthmus.cli import main
from isthmus.cli.config_keys import attribute_docs, class_doc, reference_markdown
from isthmus.config import JobConfig

ROOT = Path(__file__).resolve().parents[2]


def every_key() -> list[tuple[str, str, str]]:
    """(section, key, doc) for every field of every section, straight from the dataclasses."""
    out = []
    for section in dataclasses.fields(JobConfig):
        cls = type(getattr(JobConfig(), section.name))
        docs = attribute_docs(cls)
        out += [(section.name, f.name, docs.get(f.name, "")) for f in dataclasses.fields(cls)]
    return out


def test_every_key_and_section_has_a_doc() -> None:
    undocumented = [f"{s}.{k}" for s, k, doc in every_key() if not doc.strip()]
    assert not undocumented, f"give these fields a docstring in isthmus/config.py: {', '.join(undocumented)}"
    for section in dataclasses.fields(JobConfig):
        assert class_doc(type(getattr(JobConfig(), section.name))), f"[{section.name}] has no class docstring"


def test_train_help_lists_every_key_with_its_doc(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # the docs are wrapped to the width
    missing = [f"{s}.{k}" for s, k, doc in every_key() if f"--{s}.{k} " not in text or doc not in text]
    assert not missing, f"isthmus train --help lacks these keys or their docs: {', '.join(missing)}"


def test_the_reference_page_shows_every_key_with_its_doc() -> None:
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "docs" / "hooks" / "config_reference.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert hook.MARKER in page, "docs/configuration.md must hold the marker the hook replaces"
    assert "docs/hooks/config_reference.py" in (ROOT / "mkdocs.yml").read_text(), "mkdocs.yml must run the hook"
    built = hook.on_page_markdown(page)
    missing = [
        f"{s}.{k}" for s, k, doc in every_key() if f"`{s}.{k}`" not in built or doc.replace("|", "\\|") not in built
    ]
    assert not missing, f"the configuration reference lacks these keys or their docs: {', '.join(missing)}"
    rows = [line for line in reference_markdown().splitlines() if line.startswith("| `")]
    assert len(rows) == len(every_key()), "one row per key"
