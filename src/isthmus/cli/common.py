"""What the sub-commands share: the one-line-error argument parser and a few defaults."""

from __future__ import annotations

import argparse
from typing import NoReturn

from isthmus.errors import IsthmusError

LATEST_RUN = "runs/latest"
"""The newest run of the default train.run_dir (a link `isthmus train` updates)."""
KEY_HELP = "secret key file (default: $ISTHMUS_CHECKPOINT_KEY_FILE): {what} must be signed with it"


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the problem (not a usage block)."""

    def error(self, message: str) -> NoReturn:
        raise IsthmusError(f"{self.prog}: {message}")


def subcommand_parser() -> tuple[ArgumentParser, argparse._SubParsersAction]:
    """The top-level parser and its sub-command table, for `main` and for a parser of one sub-command."""
    parser = ArgumentParser(
        prog="isthmus",
        description="Train transformer language models in parallel, from one CPU to several datacenters.",
    )
    return parser, parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
