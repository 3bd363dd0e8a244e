import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Tests import their helpers (tests/multirank.py) by module name, from any working directory.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True, scope="module")
def _rank_pools_per_module() -> Iterator[None]:
    """The ranks that multirank keeps leave their world when a test module ends (see multirank's doc)."""
    yield
    import multirank

    multirank.POOLS.close()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the readers of the README and the manual (tests/project/test_docs_commands.py) now, when
    the session selected them: their commands then run beside the rest of the suite, not after it."""
    for item in session.items:
        if isinstance(item, pytest.Function) and item.originalname == "test_every_command_runs_as_written":
            item.module.start_readers(session)
            return
