"""docs/benchmarks.md shows plots its benchmark scripts draw: every image it links is committed beside
it, and a command on the page writes it (``--plot docs/img/<name>``), so a rerun redraws what it shows."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGE = DOCS / "benchmarks.md"


def linked_images() -> list[str]:
    """Paths, relative to docs/, of the images the page links (``![...](img/x.svg)``)."""
    return re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", PAGE.read_text())


def test_every_plot_the_page_links_is_there() -> None:
    images = linked_images()
    assert len(images) >= 5, f"docs/benchmarks.md shows {len(images)} plots: {images}"
    missing = [name for name in images if not (DOCS / name).is_file()]
    assert not missing, f"docs/benchmarks.md links plots that are not in docs/: {missing}"
    for name in images:
        head = (DOCS / name).read_bytes()[:200]
        assert head.startswith(b"\x89PNG") or b"<svg" in head or head.startswith(b"<?xml"), f"{name} is not an image"


def test_every_plot_is_written_by_a_command_on_the_page() -> None:
    drawn = set(re.findall(r"--plot (docs/\S+)", PAGE.read_text()))
    undrawn = [name for name in linked_images() if f"docs/{name}" not in drawn]
    assert not undrawn, f"no command on docs/benchmarks.md writes (--plot docs/...) these plots: {undrawn}"
