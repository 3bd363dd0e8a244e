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
