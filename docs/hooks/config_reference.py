"""MkDocs hook: the configuration reference, rendered from the config dataclasses' docstrings.

docs/configuration.md holds the marker below; the site shows every key in its place, built by
`isthmus.cli.config_keys.reference_markdown` from the same docstrings `isthmus train --help` lists.
"""

from __future__ import annotations

from typing import Any

from isthmus.cli.config_keys import reference_markdown

MARKER = "<!-- config-reference -->"


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return markdown.replace(MARKER, reference_markdown()) if MARKER in markdown else markdown
