"""Atomic file writes shared by every package: readers see the old file or the new one, never half.

The data goes to a temporary file in the destination's own directory (same filesystem), is fsynced,
then os.replace'd over the destination; on any error the temporary file is removed and the old file
stays as it was.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write(path: Path | str, data: bytes | str, mode: int = 0o644) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
