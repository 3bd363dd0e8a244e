"""Errors a user can cause. Each carries one line that names what was wrong and why.

The CLI turns an :class:`IsthmusError` into that single line on stderr and exit code 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class IsthmusError(Exception):
    """A problem with the user's input: config, CLI, topology, checkpoint or data."""


class ConfigError(IsthmusError):
    """An invalid job configuration: names the key, the value and the rule."""

    def __init__(self, key: str, value: object, rule: str) -> None:
        self.key, self.value, self.rule = key, value, rule
        super().__init__(f"{key} = {value!r}: {rule}")


class DataError(IsthmusError):
    """Training data that cannot be read or used."""


class CheckpointError(IsthmusError):
    """A training checkpoint that is missing, incomplete, damaged or saved for another model."""
