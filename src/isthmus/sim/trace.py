"""Chrome / Perfetto trace of a simulation: ``{"traceEvents": [...]}``, open in ui.perfetto.dev.

One process (pid) per simulated device and per link, one thread (tid) per stream: a device has
``compute`` (ops named like ``F mb3 L0-5``), ``tp`` and ``cp`` (collectives inside its ops),
``p2p`` (pipeline sends) and ``dp`` (gradient reductions and weight gathers); a link has one
thread for what crosses it. WAN links come last, each on its own track. Times are microseconds.
"""

from __future__ import annotations

import json
from pathlib import Path

from isthmus.sim.run import SimResult

LANES = ("compute", "tp", "cp", "p2p", "dp", "ep")


def track_order(track: str) -> tuple[int, int, str]:
    """Devices by pipeline rank, then links, then WAN links."""
    if track.startswith("device:"):
        return (0, int(track.split(":")[1]), "")
    return (2 if track.startswith("link:wan") else 1, 0, track)


def trace_events(result: SimResult) -> list[dict[str, object]]:
    tracks = sorted({e.track for e in result.trace_events} | set(result.track_names), key=track_order)
    pid = {t: i + 1 for i, t in enumerate(tracks)}
    lanes: dict[tuple[str, str], int] = {}
    out: list[dict[str, object]] = []
    for t in tracks:
        out.append(
            {"ph": "M", "name": "process_name", "pid": pid[t], "tid": 0, "args": {"name": result.track_names.get(t, t)}}
        )
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid[t], "tid": 0, "args": {"sort_index": pid[t]}})
    for e in result.trace_events:
        key = (e.track, e.lane)
        if key not in lanes:
            lanes[key] = tid = (LANES.index(e.lane) + 1) if e.lane in LANES else len(LANES) + 1
            out.append({"ph": "M", "name": "thread_name", "pid": pid[e.track], "tid": tid, "args": {"name": e.lane}})
        out.append(
            {
                "ph": "X",
                "name": e.name,
                "cat": e.cat,
                "pid": pid[e.track],
                "tid": lanes[key],
                "ts": round(e.start * 1e6, 3),
                "dur": round((e.end - e.start) * 1e6, 3),
                "args": dict(e.args),
            }
        )
    return out


def write_trace(result: SimResult, path: str | Path) -> int:
    """Write the trace; returns the number of events. ``result`` must come from ``simulate(record=True)``."""
    events = trace_events(result)
    meta = {
        "layout": result.layout.label(),
        "step_time_s": result.step_time_s,
        "runtime": result.runtime,
        "devices_represented": result.layout.world,
        "devices_simulated": result.devices_simulated,
    }
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}))
    return len(events)
