"""File-system primitives shared by every program (wheelbuilder, images, dflash).

- `REPO_ROOT`, `DIST_WHEELS`, `LOGS`: where a checkout keeps its outputs.
- `atomic_write`: readers see the old file or the new one, never half. The data goes to a temporary
  file in the destination's own directory (same filesystem), is fsynced, then os.replace'd over the
  destination; on any error the temporary file is removed and the old file stays as it was.
- `sha256_file`: the hex digest of a file (or of its first `limit` bytes), read in blocks.
- `source_date_epoch`: the one SOURCE_DATE_EPOCH default every archive and wheel uses.
- `exclusive`: one writer per directory at a time (an advisory lock file holding the holder's pid).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .errors import BusyError, ConfigurationError

REPO_ROOT = Path(__file__).resolve().parent.parent
DIST_WHEELS = REPO_ROOT / "dist" / "wheels"
LOGS = REPO_ROOT / "logs"

# 2025-01-01T00:00:00Z: the fixed time a build embeds when SOURCE_DATE_EPOCH is not set, so that no
# artifact ever carries the current time.
DEFAULT_SOURCE_DATE_EPOCH = 1735689600


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


def sha256_file(path: Path | str, limit: int | None = None, progress=None) -> str:
    """sha256 of a file, or of its first `limit` bytes; `progress(n)` is called with each block's size."""
    h = hashlib.sha256()
    left = Path(path).stat().st_size if limit is None else limit
    with open(path, "rb") as f:
        while left > 0:
            block = f.read(min(8 << 20, left))
            if not block:
                break
            h.update(block)
            left -= len(block)
            if progress is not None:
                progress(len(block))
    return h.hexdigest()


def source_date_epoch() -> int:
    """SOURCE_DATE_EPOCH from the environment, else DEFAULT_SOURCE_DATE_EPOCH."""
    raw = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if not raw:
        return DEFAULT_SOURCE_DATE_EPOCH
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigurationError(
            f"SOURCE_DATE_EPOCH={raw!r} is not a non-negative integer of seconds since 1970; "
            f"unset it or set e.g. SOURCE_DATE_EPOCH=$(git log -1 --format=%ct)"
        )
    return value


@contextmanager
def exclusive(directory: Path, what: str = "build", *, lock_name: str = ".build.lock", error: type = BusyError):
    """Hold `directory/<lock_name>` for the duration: a second writer fails fast (raising `error`, a
    BusyError by default) instead of interleaving its writes with the first one's. The file keeps the
    holder's pid for the message."""
    directory.mkdir(parents=True, exist_ok=True)
    lock_path = directory / lock_name
    # "a+" rather than "w": opening must not empty the holder's pid before we know we hold the lock.
    with open(lock_path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            raise error(
                f"another {what} is using {directory} (lock {lock_path} is held by pid {holder}). Wait for it "
                "to finish, or give this one another directory; two at once would overwrite each other."
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        yield
