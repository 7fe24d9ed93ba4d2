"""The trainer's heartbeat: a small JSON file the trainer rewrites while it runs and the image's health
check (`dflash healthcheck`) reads.

    $DFLASH_HEARTBEAT (default /tmp/dflash/heartbeat)
    {"time": unix s, "step": n, "pid": writer's pid}            while training
    {"time": ..., "step": n, "pid": ..., "finished": true}      after a deliberate end

Every write replaces the file atomically, so the health check never reads half a file.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from common.fsutil import atomic_write

HEARTBEAT_ENV, DEFAULT_HEARTBEAT = "DFLASH_HEARTBEAT", "/tmp/dflash/heartbeat"


def heartbeat_path() -> Path:
    return Path(os.environ.get(HEARTBEAT_ENV) or DEFAULT_HEARTBEAT)


def write_heartbeat(step: int, path: Path | str | None = None, *, finished: bool = False, now: float | None = None) -> Path:
    """Record that the trainer is alive at `step` (atomically). `finished=True` on a clean exit tells
    the health check that a silent heartbeat is expected from now on."""
    data = {"time": time.time() if now is None else now, "step": int(step), "pid": os.getpid()}
    if finished:
        data["finished"] = True
    return atomic_write(path or heartbeat_path(), json.dumps(data, indent=2) + "\n")


class Heartbeat:
    """The trainer's side: writes the heartbeat at most every `every` seconds to `path` (default
    $DFLASH_HEARTBEAT); `finish()` marks a deliberate end so a silent trainer is not "stalled"."""

    def __init__(self, path: Path | None = None, every: float = 5.0):
        self.path = Path(path) if path else heartbeat_path()
        self.every = every
        self._last = float("-inf")

    def beat(self, step: int, *, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.every:
            self._last = now
            self._write(step, finished=False)

    def finish(self, step: int) -> None:
        self._write(step, finished=True)

    def _write(self, step: int, finished: bool) -> None:
        try:
            write_heartbeat(step, self.path, finished=finished)
        except OSError as exc:  # a read-only /tmp must not stop training; the health check sees no beat
            logging.getLogger("dflash.train").warning("cannot write the heartbeat %s: %s", self.path, exc)
