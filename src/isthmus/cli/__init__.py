"""The `isthmus` command line: one module per sub-command, `main` the entry point.

Each sub-command module offers ``add_parser(subparsers)`` and ``run(ns, rest)``; `isthmus.cli.main`
wires them together and turns every failure into one line on stderr and the exit code of
`isthmus.errors`. The command line is the one place that writes to the console.
"""

from isthmus.cli.main import main

__all__ = ["main"]
