"""A watchdog for the network calls that wait without a limit of their own.

paramiko waits with no time limit in several places: a channel request (`exec`, the `sftp` subsystem)
waits for the host's reply, a write waits for the host to open its window, `SFTPFile.close` waits for the
last acknowledgement, `recv_exit_status` for the exit status. A host that keeps the TCP connection open
but stops answering (sshd stopped or swapping, a half-dead link, a proxy holding the port) holds each of
them forever. Closing the transport wakes every one of them with an error, so the watchdog does that:

    with Watchdog(limit, on_stall) as dog:    # on_stall closes the connection (from the watchdog's thread)
        ...                                   # dog.progress() after each step that got an answer
    dog.fired                                 # True when `limit` seconds passed without progress

Its thread lives only inside the `with` block: nothing is left running after it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Watchdog:
    """Calls `on_stall()` once when `limit` seconds pass inside the block without `progress()`."""

    def __init__(self, limit: float, on_stall: Callable[[], None]):
        self.limit = limit
        self.fired = False
        self._on_stall = on_stall
        self._cond = threading.Condition()
        self._last = time.monotonic()
        self._done = False
        self._thread = threading.Thread(target=self._watch, name="ssh-watchdog", daemon=True)

    def progress(self) -> None:
        """An answer came: the next `limit` seconds start now."""
        with self._cond:
            self._last = time.monotonic()

    def _watch(self) -> None:
        with self._cond:
            while not self._done:
                left = self._last + self.limit - time.monotonic()
                if left <= 0:
                    self.fired = True
                    break
                self._cond.wait(left)
        if self.fired:
            self._on_stall()

    def __enter__(self) -> "Watchdog":
        self._last = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        with self._cond:
            self._done = True
            self._cond.notify()
        self._thread.join()
