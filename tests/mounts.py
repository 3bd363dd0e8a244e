"""Real small file systems for the tests: a tmpfs mounted for a while (a full disk, a read-only one).

Mounting needs root; a test that needs it fails without it rather than being skipped."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(mnt: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``mnt`` (made here) with mount ``options`` (``size=8k``, ``ro,size=64k``) while
    the block runs."""
    if os.geteuid() != 0:
        pytest.fail(f"this test mounts a tmpfs ({options}), which needs root; run it as root")
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
