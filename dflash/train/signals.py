"""Stopping a run cleanly: SIGTERM (docker stop, a scheduler's preemption) and SIGINT (Ctrl-C) set a flag;
the training loop finishes the step it is in, writes a checkpoint and returns. A second Ctrl-C stops at
once."""

from __future__ import annotations

import logging
import signal

log = logging.getLogger("dflash.train")


class StopFlag:
    """Set by SIGTERM/SIGINT (or by a caller); the loop finishes the current step, checkpoints, exits."""

    def __init__(self):
        self.reason: str | None = None
        self._previous: dict = {}

    def request(self, reason: str = "request") -> None:
        self.reason = self.reason or reason

    def __bool__(self) -> bool:
        return self.reason is not None

    def install(self) -> "StopFlag":
        def handler(signum, _frame):
            name = signal.Signals(signum).name
            if self.reason and signum == signal.SIGINT:  # a second Ctrl-C: stop now
                raise KeyboardInterrupt
            self.request(name)
            log.warning("%s received: finishing the current step, then writing a checkpoint", name)

        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread: signals stay with whoever owns them
                pass
        return self

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()

    @property
    def exit_code(self) -> int:
        """128 + the signal after one (130 Ctrl-C, 143 SIGTERM: a scheduler or `docker stop` can tell the
        run was stopped, not finished; the checkpoint is written either way), 0 after a request."""
        return {"SIGINT": 130, "SIGTERM": 143}.get(self.reason or "", 0)
