"""Every command the README and docs/ show runs as written, so they cannot drift from the code
(how: tests/docs_commands.py). docs/benchmarks.md, the longest after the README, has a module of its own
(tests/test_docs_benchmarks.py) so that another test worker runs it beside this one."""

from __future__ import annotations

import pytest

from docs_commands import NOT_HERE, ROOT, SUITE, _without_comment, commands, documents, make_user, run_document

OWN_MODULE = {"benchmarks.md"}


def test_the_docs_show_commands_and_every_exception_is_still_there() -> None:
    every = [c for doc in documents() for c in commands(doc)]
    texts = {_without_comment(c.text) for c in every}
    assert len(every) > 30, [c.text for c in every]
    for text in NOT_HERE:
        assert text in texts, f"NOT_HERE lists a command no document shows any more: {text}"
    ci = (ROOT / ".ci" / "run").read_text()
    assert SUITE.replace("pip install", "pip install -q") in ci, "CI must run the README's test command"


@pytest.fixture(scope="module")
def user(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    return make_user(tmp_path_factory)


@pytest.mark.parametrize("doc", [p.name for p in documents() if p.name not in OWN_MODULE])
def test_every_command_runs_as_written(doc: str, user: dict[str, object]) -> None:
    run_document(doc, user)


def test_every_document_is_run_by_one_module() -> None:
    assert OWN_MODULE <= {p.name for p in documents()}
