"""Errors a user can cause or meet. Each carries one line that names what was wrong and why.

The CLI turns an :class:`IsthmusError` into that single line on stderr and the error's
``exit_code``; anything else is a bug and keeps its traceback. The exit codes, in one place:

==== ==================================================================================
0    success
1    a bug in isthmus (a traceback)
2    bad input, found before any work starts: config, CLI, topology, checkpoint, data
3    a run that started and then failed for a reason the user can act on: a full disk,
     a stalled or dead rank, a non-finite loss, memory that ran out
130  interrupted (SIGINT, Ctrl-C); 128 + N for another signal N (SIGTERM: 143)
==== ==================================================================================
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

EXIT_OK = 0
EXIT_BUG = 1
EXIT_USAGE = 2
EXIT_RUN_FAILED = 3
EXIT_INTERRUPTED = 130


class IsthmusError(Exception):
    """A problem with the user's input: config, CLI, topology, checkpoint or data."""

    exit_code = EXIT_USAGE


class ConfigError(IsthmusError):
    """An invalid job configuration: names the key, the value and the rule."""

    def __init__(self, key: str, value: object, rule: str) -> None:
        self.key, self.value, self.rule = key, value, rule
        super().__init__(f"{key} = {value!r}: {rule}")


class DataError(IsthmusError):
    """Training data that cannot be read or used."""


class CheckpointError(IsthmusError):
    """A training checkpoint that is missing, incomplete, damaged or saved for another model."""


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint whose files would run code when loaded: always refused, never skipped like a damaged one."""


class RunFailed(IsthmusError):
    """A run that started and failed for a reason the user can act on (full disk, stalled rank, divergence)."""

    exit_code = EXIT_RUN_FAILED


class Interrupted(IsthmusError):
    """The run was stopped by a signal; ``exit_code`` is 128 + the signal's number."""

    def __init__(self, signum: int, message: str) -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(message)


def is_no_space(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an error it was raised from, is a full disk (ENOSPC) or quota (EDQUOT)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def no_space(what: str, path: str | Path, key: str) -> RunFailed:
    """The one line for a write that found the disk full: what, where, and the key that moves it."""
    return RunFailed(
        f"no space left on device writing the {what} {path}; free space there or set {key} to another disk"
    )


@contextmanager
def full_disk_as(what: str, path: str | Path, key: str) -> Iterator[None]:
    """Within the block, an OSError of a full disk becomes :func:`no_space`'s one line; others pass."""
    try:
        yield
    except OSError as e:
        if is_no_space(e):
            raise no_space(what, path, key) from None
        raise
