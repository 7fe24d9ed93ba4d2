"""Stopping a run cleanly: SIGTERM (docker stop, a scheduler's preemption) and SIGINT (Ctrl-C) set a flag;
the training loop finishes the step it is in (or the checkpoint it is writing), writes a checkpoint and
returns. A second Ctrl-C stops at once.

Under torchrun every process of the run stops the same way and ends with the signal's code (143, 130),
whichever rank the signal reached: the ranks agree on the stop each step (StopFlag.agreed), and a rank
stopped by another rank's signal takes it as its own. Two things of torchrun's need more:
- its agent closes the ranks still running with SIGTERM as soon as one rank exits, which would turn a
  stopping rank's 143 into a death by signal while it still writes its report: once stopped by a
  signal, a rank under torchrun ignores SIGTERM and SIGINT until it exits (uninstall);
- its workers run in sessions of their own, so a SIGKILL of the launcher (or of its process group) would
  leave them training with nobody to report to: each worker asks the kernel for SIGTERM when the
  launcher dies (PR_SET_PDEATHSIG), and stops as on any SIGTERM.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal

log = logging.getLogger("dflash.train")

EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}  # 128 + the signal, as a shell reports a process it ended
PR_SET_PDEATHSIG = 1  # prctl(2)


def under_torchrun() -> bool:
    """Whether torchrun's agent (plain torchrun or dflash-train --nproc-per-node) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ


class StopFlag:
    """Set by SIGTERM/SIGINT (or by a caller); the loop finishes the current step, checkpoints, exits."""

    def __init__(self):
        self.reason: str | None = None
        self.by_another_rank = False  # the stop came from another rank's signal (or request)
        self._previous: dict = {}
        self._launcher: int | None = None

    def request(self, reason: str = "request") -> None:
        self.reason = self.reason or reason

    def __bool__(self) -> bool:
        return self.reason is not None

    def describe(self) -> str:
        """What stopped the run, for its log: "SIGTERM", or "SIGTERM received by another rank"."""
        return f"{self.reason} received by another rank" if self.by_another_rank else str(self.reason)

    def install(self) -> "StopFlag":
        def handler(signum, _frame):
            name = signal.Signals(signum).name
            if self.reason and signum == signal.SIGINT:  # a second Ctrl-C: stop now
                raise KeyboardInterrupt
            self.request(name)
            if self._launcher is not None and os.getppid() != self._launcher:
                log.warning("the launcher (pid %d) went away, which sends this process %s: finishing the current "
                            "step, then writing a checkpoint", self._launcher, name)
            else:
                log.warning("%s received: finishing the current step, then writing a checkpoint", name)

        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread: signals stay with whoever owns them
                pass
        if self._previous and under_torchrun():
            self._launcher = _term_when_the_launcher_dies()
        return self

    def uninstall(self) -> None:
        """Give the signals back; under torchrun, after a stop by a signal, ignore them until the exit
        (module docstring: torchrun's SIGTERM to the ranks still running would end this one by signal)."""
        keep_out = self.exit_code != 0 and under_torchrun()
        for sig, prev in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if keep_out else prev)
        self._previous.clear()

    def status(self) -> int:
        """What this rank tells the others: its exit code after a signal (143, 130), 1 after a request, 0."""
        return self.exit_code or (1 if self else 0)

    def adopt(self, status: int) -> None:
        """Stop as another rank's `status` says: its signal counts as this rank's (the run stops because
        of it, and every process of a stopped run exits with its code)."""
        if self or not status:
            return
        self.request(next((name for name, code in EXIT_CODES.items() if code == status), "request"))
        self.by_another_rank = True

    def agreed(self, d) -> bool:
        """Whether any rank of `d` stops, on every rank (a collective: each rank calls it at the same point)."""
        from dflash import distributed

        self.adopt(distributed.max_over_ranks(d, self.status()))
        return bool(self)

    @property
    def exit_code(self) -> int:
        """128 + the signal after one (130 Ctrl-C, 143 SIGTERM: a scheduler or `docker stop` can tell the
        run was stopped, not finished; the checkpoint is written either way), 0 after a request."""
        return EXIT_CODES.get(self.reason or "", 0)


def _term_when_the_launcher_dies() -> int | None:
    """Ask Linux for SIGTERM when this process's parent (torchrun's agent) dies; returns the parent's pid,
    or None where prctl is not there (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return os.getppid()
