"""`isthmus COMMAND ...`: the sub-commands wired together; every failure one line and an exit code.

Every failure a user can cause or meet becomes one line on stderr and the exit code of
`isthmus.errors` (2 bad input, 3 a run that failed, 128 + N a signal).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence

from isthmus.cli import emulate, export, generate, plan, profile, simulate, tokenize, train
from isthmus.cli.common import subcommand_parser
from isthmus.errors import EXIT_INTERRUPTED, EXIT_USAGE, Interrupted, IsthmusError
from isthmus.log import setup_logging

COMMANDS = (train, generate, export, tokenize, plan, simulate, profile, emulate)
"""In the order `isthmus --help` lists them."""
TAKES_REST = {"train", "emulate", "tokenize"}
"""Sub-commands whose arguments go on past what their parser knows (config overrides, a train command)."""


def build_parser() -> argparse.ArgumentParser:
    parser, sub = subcommand_parser()
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    runners: dict[str, Callable[[argparse.Namespace, list[str]], int]] = {
        c.__name__.rsplit(".", 1)[1]: c.run for c in COMMANDS
    }
    try:
        if not argv:
            parser.print_help()
            return EXIT_USAGE
        ns, rest = parser.parse_known_args(argv)
        if ns.command not in runners:
            parser.print_help()
            return EXIT_USAGE
        if ns.command == "emulate":
            setup_logging()
            rest = rest[1:] if rest[:1] == ["--"] else rest
        elif rest and ns.command not in TAKES_REST:
            raise IsthmusError(f"isthmus {ns.command}: unrecognized arguments: {' '.join(rest)}")
        return runners[ns.command](ns, rest)
    except Interrupted as e:
        sys.stderr.write(f"isthmus: {e}\n")
        return e.exit_code
    except IsthmusError as e:
        sys.stderr.write(f"isthmus: error: {e}\n")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("isthmus: interrupted\n")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader of stdout left (`isthmus plan | head`): nothing to say to anyone. stdout goes to
        # /dev/null so Python's flush at exit does not raise again; the exit code is the shell's for
        # a process that SIGPIPE ended.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
