"""The figures benchmark scripts draw with ``--plot PATH``: matplotlib, imported only when asked for.

A script runs and prints its table without matplotlib; with ``--plot`` and no matplotlib it says so
and still succeeds (``pip install -c constraints.txt -e '.[plot]'`` installs it). SVGs are written
without a date and with a fixed id salt, so the same figures give the same file.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

COLORS = {
    "isthmus": "#1f77b4",
    "torch": "#ff7f0e",
    "colossalai": "#2ca02c",
    "measured": "#1f77b4",
    "planned": "#ff7f0e",
    "rest": "#9ecae1",
}


def pyplot() -> Any | None:
    """matplotlib.pyplot on the Agg backend, or None (and a note on stderr) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is not installed (pip install -c constraints.txt -e '.[plot]')", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.hashsalt": "isthmus", "svg.fonttype": "none", "font.size": 9})
    return plt


def save(fig: Any, path: str | Path) -> None:
    """Write ``fig`` to ``path`` (its suffix picks the format) and close it."""
    import matplotlib.pyplot as plt

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"Date": None} if out.suffix == ".svg" else None
    fig.tight_layout()
    fig.savefig(out, metadata=metadata)
    plt.close(fig)
    print(f"plot: {out}", file=sys.stderr)
