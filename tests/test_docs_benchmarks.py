"""Every command of docs/benchmarks.md runs as written (tests/docs_commands.py), in a fresh copy of its own
after the README's install command: apart from the README's module, so that two test workers share the two."""

from __future__ import annotations

import pytest

from docs_commands import make_user, run_document


@pytest.fixture(scope="module")
def user(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    return make_user(tmp_path_factory)


def test_every_command_runs_as_written(user: dict[str, object]) -> None:
    run_document("benchmarks.md", user)
