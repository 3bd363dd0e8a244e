import sys
from pathlib import Path

# Tests import their helpers (tests/multirank.py) by module name, from any working directory.
sys.path.insert(0, str(Path(__file__).parent))
