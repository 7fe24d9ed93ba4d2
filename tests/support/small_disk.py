"""A small real filesystem for the "disk full" tests: a tmpfs of a given size (root only; the test is skipped
where mounting is refused), and a filler file that leaves a chosen amount of it free.

    with small_disk(tmp_path / "disk", "16m") as disk:
        filler = fill(disk, leave=1 << 20)        # 1 MiB free: the next large write fails with ENOSPC
        ...
        filler.unlink()                           # room again
"""

from __future__ import annotations

import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_disk(path: Path, size: str = "96m"):
    """A tmpfs of `size` (mount's notation: 96m, 512k) mounted at `path` for the `with` block."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(disk: Path, leave: int) -> Path:
    """A file on `disk` that takes all of its free space but `leave` bytes; returns it."""
    filler = disk / "filler"
    size = shutil.disk_usage(disk).free - leave
    with open(filler, "wb") as fh:
        for _ in range(size >> 20):
            fh.write(bytes(1 << 20))
        fh.write(bytes(size & ((1 << 20) - 1)))
    return filler
