"""torchrun's elastic agent for one emulated datacenter, with its exit said as an exit code.

`isthmus emulate` runs ``python -m isthmus.launch.agent <torchrun arguments>`` in each datacenter's
namespace: the same agent as ``python -m torch.distributed.run`` (same arguments, same
rendezvous, same workers), but its own ends are not tracebacks. torchrun turns a worker that failed
into a ``ChildFailedError`` traceback and the emulator's stop (SIGTERM) into a ``SignalException``
traceback, each after its own log lines; the workers' output says what failed, and the emulator
says the rest in one line (`isthmus.cli.emulate`).

Exit codes: 0 when every worker succeeded; the first failed worker's exit code (1 when it has
none of its own: killed by a signal); 128 + N when the agent was stopped by signal N.
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def main(argv: list[str]) -> int:

    # The agent logs each failed worker and each survivor it stops; the workers' own output and the
    # emulator's line say it better. Each elastic module's logger has a level of its own (torch sets
    # it from LOGLEVEL as the module is imported, above), so the parent's would not do.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        first = e.failures[min(e.failures)]
        return first.exitcode if first.exitcode > 0 else 1
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
