"""One error type per failure class, each with its own exit code (cibuildwheel's pattern).

Messages say what failed, the values seen, and what to do next. `__main__.main()` catches FatalError,
prints it and exits with its code; everything below it only raises, so tests call it directly.

    1 FatalError  2 configuration  3 toolchain  4 source  5 build  6 audit  7 busy (lock held)
    130 Ctrl-C (SIGINT)  143 SIGTERM: both stop the child processes (their whole process group) and
        remove the staging folder; nothing half-written is left in the output directory.
"""


import signal
import sys
from collections.abc import Callable


class FatalError(Exception):
    """A failure that stops the build; `str()` is the full, user-facing message."""

    exit_code = 1


class ConfigurationError(FatalError):
    """targets.toml, a recipe or a command-line option is wrong (unknown target, bad arch, ...)."""

    exit_code = 2


class ToolchainError(FatalError):
    """The toolchain cannot build this target: no nvcc, nvcc too old for an arch, CUDA mismatch."""

    exit_code = 3


class SourceError(FatalError):
    """The pinned source is unavailable or does not match its sha256, or a recipe patch no longer applies."""

    exit_code = 4


class BuildError(FatalError):
    """The compile itself failed (the log file holds the full output)."""

    exit_code = 5


class AuditError(FatalError):
    """A built wheel failed its audit; it was not written to dist/."""

    exit_code = 6


class BusyError(FatalError):
    """Another build holds the lock on the same output directory or build directory."""

    exit_code = 7


class Terminated(KeyboardInterrupt):
    """SIGTERM (docker stop, a CI time-out, systemd) raised in the main thread. It is a KeyboardInterrupt,
    so every clean-up written for Ctrl-C (killing child process groups, removing staging folders) runs
    for it as well."""


EXIT_SIGINT = 130  # 128 + SIGINT: the shell's convention for a Ctrl-C'd command
EXIT_SIGTERM = 143  # 128 + SIGTERM


def _raise_terminated(signum, _frame):
    raise Terminated(signal.Signals(signum).name)


def run_cli(prog: str, body: Callable[[], int], interrupted: str = "interrupted") -> int:
    """A command-line entry point's frame: FatalError -> its message and exit code; Ctrl-C -> 130;
    SIGTERM -> the same clean-up as Ctrl-C, then 143."""
    try:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread: SIGTERM stays with whoever owns it
        previous = None
    try:
        return body()
    except FatalError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.exit_code
    except Terminated:
        print(f"{prog}: SIGTERM received: {interrupted}", file=sys.stderr)
        return EXIT_SIGTERM
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return EXIT_SIGINT
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
