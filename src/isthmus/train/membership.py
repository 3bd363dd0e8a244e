"""Which host each rank of a multi-node run is on, and what changed since the run's last start.

An elastic run (``torchrun --nnodes MIN:MAX`` with ``--max-restarts``) restarts its ranks when a
host dies (at the smaller world) or comes back (at the larger one), and resumes from the newest
checkpoint. What the user needs then is one line on the console: which host left or joined, from
which step the run continues, how many steps were lost, and at which world and data-parallel
degree. The hosts of the last start are kept in ``<run_dir>/logs/hosts.json`` (rank 0 writes it at
every start of a multi-node run) and compared with those of this start.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from isthmus.errors import IsthmusError, RunFailed

HOSTS_FILE = "hosts.json"
"""In ``<run_dir>/logs``: the hostname of each global rank at the run's last start."""


def multi_node() -> bool:
    """True in a run torchrun started on more than one node (the same answer on every rank)."""
    return int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1


def gather_hosts(world: int) -> list[str]:
    """The hostname of every global rank, in rank order (a collective when ``world`` > 1)."""
    import torch.distributed as dist  # here: the command line reads the record without loading torch

    here = socket.gethostname()
    if world == 1:
        return [here]
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, here)
    return [str(h) for h in hosts]


def read_hosts(path: Path) -> list[str] | None:
    """The hosts ``path`` recorded, or None when there is no readable record."""
    try:
        hosts = json.loads(path.read_text())["hosts"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
        return None
    return hosts


def write_hosts(path: Path, hosts: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"world": len(hosts), "hosts": hosts}) + "\n")
        tmp.replace(path)
    except OSError:  # a full disk: the next start only lacks the comparison
        pass


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


@dataclass(frozen=True)
class HostChange:
    """Hosts that left or joined between two starts of a run."""

    left: dict[str, list[int]]
    """Each host that left, with the global ranks it held before."""
    joined: dict[str, list[int]]
    """Each host that joined, with the global ranks it holds now."""

    def __bool__(self) -> bool:
        return bool(self.left or self.joined)

    def __str__(self) -> str:
        parts = [f"{h} left ({_ranks(r)})" for h, r in self.left.items()]
        parts += [f"{h} joined ({_ranks(r)})" for h, r in self.joined.items()]
        return ", ".join(parts)


def host_change(before: list[str], after: list[str]) -> HostChange:
    """What changed from the hosts of one start (``before``, one per rank) to the next."""

    def by_host(hosts: list[str]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for rank, host in enumerate(hosts):
            out.setdefault(host, []).append(rank)
        return out

    old, new = by_host(before), by_host(after)
    return HostChange({h: r for h, r in old.items() if h not in new}, {h: r for h, r in new.items() if h not in old})


def resume_line(change: HostChange, resume_step: int | None, reached: int, world: int, dp: int) -> str:
    """The console line of a run that starts again on other hosts; ``reached``: the last step it logged."""
    at = f"at world {world}, dp {dp}"
    if resume_step is None:
        return f"isthmus: {change}; no checkpoint to resume from: starting over ({reached} steps lost) {at}"
    lost = max(0, reached - resume_step)
    return f"isthmus: {change}; resuming from step {resume_step} ({lost} step{'s' if lost != 1 else ''} lost) {at}"


def cannot_continue(e: IsthmusError, run_dir: Path, world: int) -> IsthmusError:
    """A layout refused when a multi-node run starts again on fewer ranks than at its last start (a host
    left): the line says so, as a run that failed; any other refusal stays as it was."""
    before = read_hosts(run_dir / "logs" / HOSTS_FILE)
    if before is None or len(before) <= world:
        return e
    # One rank left: it is this host's (no process group yet to ask the others').
    what = (
        str(host_change(before, [socket.gethostname()])) if world == 1 else f"hosts left ({len(before)} ranks before)"
    )
    return RunFailed(
        f"{what}: the run cannot continue at world {world}: {e}; start it again with a layout for {world} "
        "rank(s) (checkpoint.resume = auto continues from its newest checkpoint), or bring the hosts back"
    )


def last_logged_step(path: Path) -> int:
    """The last step ``metrics.jsonl`` records (0 if none); a line torn by a killed writer is skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0
