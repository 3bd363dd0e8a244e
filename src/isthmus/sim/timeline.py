"""A PNG timeline of a simulation: one row per device stream and per link, idle left blank.

Rows, top to bottom: for every simulated device its compute stream (forward, backward, weight
gradient, recomputation, optimizer; tensor-parallel collectives drawn inside the ops) and its
communication (pipeline sends, gradient reductions, weight gathers), then every link, WAN links
last in red. Bubbles are the white gaps in the compute rows. matplotlib is the optional ``plot``
extra and is imported only here.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from isthmus.errors import IsthmusError
from isthmus.sim.run import SimResult
from isthmus.sim.trace import track_order

COLOURS = {
    "fwd": "#4C78A8",
    "bwd": "#F58518",
    "wgrad": "#54A24B",
    "recompute": "#B279A2",
    "optimizer": "#9D755D",
    "tp": "#72B7B2",
    "cp": "#EECA3B",
    "ep": "#B6992D",
    "p2p": "#79706E",
    "dp": "#FF9DA6",
    "wan": "#E45756",
}
LABELS = {
    "fwd": "forward",
    "bwd": "backward",
    "wgrad": "weight grad (zero bubble W)",
    "recompute": "recompute",
    "optimizer": "optimizer",
    "tp": "tp / sp collective",
    "cp": "cp exchange",
    "ep": "ep all-to-all",
    "p2p": "pipeline send",
    "dp": "dp reduce / gather",
    "wan": "WAN transfer",
}


def write_png(result: SimResult, path: str | Path, width: float = 14.0) -> None:
    """Draw ``result`` (from ``simulate(record=True)``) to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise IsthmusError("--png needs matplotlib: pip install -c constraints.txt -e '.[plot]'") from None
    rows: dict[tuple[str, str], dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for e in result.trace_events:
        if e.track.startswith("device:"):
            row = "compute" if e.lane in ("compute", "tp", "cp", "ep") else "comm"
        else:
            row = "link"
        rows[(e.track, row)][e.cat].append((e.start, e.end - e.start))
    order = sorted(rows, key=lambda k: (track_order(k[0]), k[1] != "compute"))
    height = 1.6 + 0.32 * len(order)
    fig, ax = plt.subplots(figsize=(width, height))
    ticks, names = [], []
    for y, (track, row) in enumerate(order):
        for cat in ("fwd", "bwd", "wgrad", "recompute", "optimizer", "p2p", "dp", "wan", "tp", "cp", "ep"):
            spans = rows[(track, row)].get(cat)
            if not spans:
                continue
            inner = cat in ("tp", "cp", "ep") and row == "compute"  # collectives inside ops: a thinner bar on top
            ax.broken_barh(
                [(s * 1e3, d * 1e3) for s, d in spans],
                (y - (0.15 if inner else 0.38), 0.3 if inner else 0.76),
                facecolors=COLOURS.get(cat, "#999999"),
                linewidth=0,
            )
        ticks.append(y)
        label = result.track_names.get(track, track)
        names.append(label if row in ("compute", "link") else "  sends / dp")
    ax.set_yticks(ticks, names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    lay = result.layout
    ax.set_title(
        f"{lay.label()}: {result.step_time_s * 1e3:.1f} ms/step simulated, bubble "
        f"{100 * result.bubble_fraction:.0f}%, {lay.world:,} devices ({result.devices_simulated} simulated)",
        fontsize=9,
    )
    used = {c for r in rows.values() for c in r}
    fig.legend(
        handles=[Patch(color=COLOURS[c], label=LABELS[c]) for c in COLOURS if c in used],
        loc="lower center",
        ncol=6,
        fontsize=7,
        frameon=False,
    )
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout(rect=(0, 0.45 / height, 1, 1))  # room for the legend below the time axis
    fig.savefig(path, dpi=130)
    plt.close(fig)
