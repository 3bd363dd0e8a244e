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


FIRST = ("test_docs_commands.py", "test_docs_benchmarks.py")
"""The longest modules (every command of the README, of docs/benchmarks.md), started first on the two
workers (pyproject's addopts) so that neither runs alone at the end."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return FIRST.index(name) if name in FIRST else len(FIRST)

    items.sort(key=rank)
