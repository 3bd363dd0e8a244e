"""torchrun's elastic agent for one emulated datacenter or host, with its exit said as an exit code.

`isthmus emulate` runs ``python -m isthmus.launch.agent <torchrun arguments>`` in each datacenter's
namespace (``--hosts``: on each emulated host, `isthmus.launch.hosts`): the same agent as ``python -m torch.distributed.run`` (same arguments, same
rendezvous, same workers), but its own ends are not tracebacks. torchrun turns a worker that failed
into a ``ChildFailedError`` traceback and the emulator's stop (SIGTERM) into a ``SignalException``
traceback, each after its own log lines; the workers' output says what failed, and the emulator
says the rest in one line (`isthmus.cli.emulate`).

Ranks that run the ``isthmus`` command are forked from a preloaded interpreter
(`isthmus.launch.warm`), not started as ``python -u -m isthmus ...`` that each import torch: the same
command line, run by `run_module` in a fork of the agent's server.

Exit codes: 0 when every worker succeeded; the first failed worker's exit code (1 when it has
none of its own: killed by a signal); 128 + N when the agent was stopped by signal N; the job's
code when every rank of this host was stopped (SIGSTOP) as the job ended (`jobwatch.HostGuard`).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from isthmus.launch.environ import AGENT_DIR_ENV
from isthmus.launch.warm import START_METHOD, run_module, start_rank_server, unbuffered_ranks


def main(argv: list[str]) -> int:
    guard = _guard_folder(argv)
    try:
        return _run(argv, guard)
    finally:
        if guard is not None:
            shutil.rmtree(guard, ignore_errors=True)


def _guard_folder(argv: list[str]) -> Path | None:
    """A folder for this host's ranks to name themselves in (`HostGuard`), on a job of several nodes;
    set in the environment before the ranks' server starts, so every rank inherits it."""
    given = [b for a, b in zip(argv, argv[1:], strict=False) if a == "--nnodes"]
    nnodes = (given + [a.split("=", 1)[1] for a in argv if a.startswith("--nnodes=")] + ["1"])[0]
    if nnodes.split(":")[-1] == "1":
        return None
    folder = Path(tempfile.mkdtemp(prefix="isthmus-agent-"))
    os.environ[AGENT_DIR_ENV] = str(folder)
    return folder


def _run(argv: list[str], guard: Path | None) -> int:
    forked = any(a == "-m" and b == "isthmus" for a, b in zip(argv, argv[1:], strict=False))
    if forked:
        # The ranks' server imports torch beside this process's own import (just below), not after it.
        unbuffered_ranks()
        start_rank_server()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    # The agent logs each failed worker and each survivor it stops; the workers' own output and the
    # emulator's line say it better. Each elastic module's logger has a level of its own (torch sets
    # it from LOGLEVEL as the module is imported, above), so the parent's would not do.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    if guard is not None:
        from isthmus.launch.jobwatch import HostGuard

        HostGuard(guard).start()
    try:
        # torchrun's own steps (torch.distributed.run.run, c10d as the emulator writes it), with an
        # ``-m isthmus`` target run as a function in forks of the server.
        args = parse_args(argv)
        config, entrypoint, entry_args = config_from_args(args)
        entry: Any = entrypoint
        entry_argv: list[Any] = list(entry_args)
        if forked and args.module and args.training_script == "isthmus":
            config.start_method = START_METHOD
            entry, entry_argv = run_module, [args.training_script, list(args.training_script_args)]
        elastic_launch(config, entry)(*entry_argv)
    except ChildFailedError as e:
        _keep_store_up(args.nnodes, args.rdzv_conf)
        first = e.failures[min(e.failures)]
        return first.exitcode if first.exitcode > 0 else 1
    except SignalException as e:
        _keep_store_up(args.nnodes, args.rdzv_conf)
        return 128 + int(e.sigval)
    return 0


STORE_GRACE_S = 3.0
"""How long a failed job's agent stays, when the job has several nodes, before it exits."""


def _keep_store_up(nnodes: str, rdzv_conf: str) -> None:
    """A job of several nodes failed: stay a moment before exiting. The c10d store may live in this
    agent (the rendezvous host's; not when the store is someone else's, ``is_host=0``), kept alive
    while the failure is handled here; another node's agent that finds it gone before its own ranks
    have ended fails with a traceback of its own and stops them before they say why they ended
    (`isthmus.launch.jobwatch`). A signal cuts the wait short."""
    if nnodes.split(":")[-1] == "1" or "is_host=0" in rdzv_conf.replace(" ", ""):
        return
    try:
        time.sleep(STORE_GRACE_S)
    except BaseException:  # torch's handlers turn a signal into an exception; the exit code stands
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
