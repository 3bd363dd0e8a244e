"""The one logger of isthmus, rank-aware.

Library code logs through :func:`get_logger`; only the CLI writes to the console directly.
In multi-rank runs the launcher configures handlers so that rank 0 drives the console and every
rank writes its own file in the run directory.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.logging import RichHandler

LOGGER_NAME = "isthmus"


def get_logger() -> logging.Logger:
    """Return the isthmus logger."""
    return logging.getLogger(LOGGER_NAME)


def current_rank() -> int:
    """The global rank of this process from the launcher's environment (0 when not launched)."""
    return int(os.environ.get("RANK", "0"))


class _LogFile(logging.FileHandler):
    """A rank's log file. A write that fails (a full disk) drops that line silently instead of
    printing logging's own traceback: the run's error names the full disk in one line."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass


def setup_logging(
    level: int = logging.INFO,
    log_file: str | None = None,
    console: bool = True,
    console_stream: TextIO | None = None,
) -> logging.Logger:
    """Configure the isthmus logger: a console handler (rich when available) and an optional file.

    ``console_stream`` is where the console is (default: stderr), for a rank whose stderr is its log file.
    """
    logger = get_logger()
    logger.setLevel(level)
    logger.propagate = False
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()
    if console:
        stream = console_stream or sys.stderr
        handler: logging.Handler
        if stream.isatty():
            handler = RichHandler(console=Console(file=stream), show_path=False, show_time=False, markup=False)
        else:  # logs and CI: plain lines, no wrapping at 80 columns
            handler = logging.StreamHandler(stream)
            handler.setFormatter(logging.Formatter("%(message)s"))
        handler.setLevel(level)
        logger.addHandler(handler)
    if log_file:
        fh = _LogFile(log_file)
        fh.setFormatter(logging.Formatter(f"%(asctime)s [rank{current_rank()}] %(levelname)s %(message)s"))
        logger.addHandler(fh)
    return logger


def silence_console() -> None:
    """Keep only the log file: a rank that stops leaves the console to the launcher's one line."""
    logger = get_logger()
    for h in list(logger.handlers):
        if not isinstance(h, logging.FileHandler):
            logger.removeHandler(h)


def redirect_stderr(log_file: str | Path) -> TextIO:
    """Point this process's stderr (file descriptor 2) at ``log_file``; return a stream on the old stderr.

    What a rank writes below the isthmus logger (torch's log lines and warnings, gloo's and c10d's
    C++ messages, a traceback) then lands in its log file, never on the console; the returned stream
    is the console, for the rank that drives it. At the descriptor, not ``sys.stderr``, because C++
    writes to descriptor 2 directly.
    """
    sys.stderr.flush()
    console_fd = os.dup(2)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    return os.fdopen(console_fd, "w", buffering=1)


def route_library_warnings() -> None:
    """Warnings from torch and other libraries go to this rank's log file only; isthmus's own stay on the logger.

    A user cannot act on torch's (DTensor's "2 sequential all_reduce operations", DCP's notes); what
    isthmus warns about, they can. Both Python warnings and records of torch's own loggers are routed.
    """
    files = [h for h in get_logger().handlers if isinstance(h, logging.FileHandler)]
    # torch's logging setup gives "torch" and many loggers under it a console handler of their own.
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and (name == "torch" or name.startswith("torch.")):
            consoles = [h for h in logger.handlers if type(h) is logging.StreamHandler]
            for h in consoles:
                logger.removeHandler(h)
            if consoles:
                for h in files:
                    logger.addHandler(h)
    package = str(Path(__file__).parent)

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        text = f"{category.__name__}: {message} ({filename}:{lineno})"
        if filename.startswith(package):
            get_logger().warning("%s", text)
            return
        record = logging.LogRecord("py.warnings", logging.WARNING, filename, lineno, "%s", (text,), None)
        for h in files:
            h.handle(record)

    warnings.showwarning = show
