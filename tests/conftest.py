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
