"""The one logger of isthmus, rank-aware.

Library code logs through :func:`get_logger`; only the CLI writes to the console directly.
In multi-rank runs the launcher configures handlers so that rank 0 drives the console and every
rank writes its own file in the run directory.
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "isthmus"


def get_logger() -> logging.Logger:
    """Return the isthmus logger."""
    return logging.getLogger(LOGGER_NAME)


def current_rank() -> int:
    """The global rank of this process from the launcher's environment (0 when not launched)."""
    return int(os.environ.get("RANK", "0"))


def setup_logging(level: int = logging.INFO, log_file: str | None = None, console: bool = True) -> logging.Logger:
    """Configure the isthmus logger: a console handler (rich when available) and an optional file."""
    logger = get_logger()
    logger.setLevel(level)
    logger.propagate = False
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()
    if console:
        handler: logging.Handler
        if sys.stderr.isatty():
            from rich.logging import RichHandler

            handler = RichHandler(show_path=False, show_time=False, markup=False)
        else:  # logs and CI: plain lines, no wrapping at 80 columns
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(message)s"))
        handler.setLevel(level)
        logger.addHandler(handler)
    if log_file:
        fh = logging.FileHandler(log_file)
        fh.setFormatter(logging.Formatter(f"%(asctime)s [rank{current_rank()}] %(levelname)s %(message)s"))
        logger.addHandler(fh)
    return logger
