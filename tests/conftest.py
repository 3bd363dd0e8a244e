import sys
from pathlib import Path

# Tests import their helpers (tests/multirank.py) by module name, from any working directory.
sys.path.insert(0, str(Path(__file__).parent))


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001 - pytest's hook signature
    """The ranks that multirank keeps for the session leave their world before pytest exits."""
    import multirank

    multirank.POOLS.close()
