"""The discrete-event simulator: a layout's steps op by op, as a trace and a timeline.

``simulate(work, topology, layout, runtime)`` replays the planner's per-op costs on a clock: a
compute stream per simulated device, transfers on links that share their bandwidth, the pipeline
schedule action by action per microbatch as torch runs it. It reports the planner's figures
(``SimResult.as_json`` has the keys of ``isthmus plan --json``); ``write_trace`` writes a
Chrome/Perfetto trace and ``write_png`` a timeline. Pure Python, like the planner: no torch.

- engine.py: clock, devices, processor-sharing links, transfers;
- schedule.py: torch's pipeline action orders (gpipe, 1f1b, interleaved, zero bubble);
- costs.py: the planner's numbers cut into ops and collective phases;
- program.py: one replica of a layout wired into the engine (and why one is enough);
- run.py: ``simulate`` and ``SimResult``; trace.py, timeline.py: the outputs.
"""

from isthmus.sim.run import SimResult, simulate
from isthmus.sim.timeline import write_png
from isthmus.sim.trace import write_trace

__all__ = ["SimResult", "simulate", "write_png", "write_trace"]
