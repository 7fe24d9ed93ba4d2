"""One error type per failure class, each with its own exit code (cibuildwheel's pattern).

Messages say what failed, the values seen, and what to do next. `__main__.main()` catches FatalError,
prints it and exits with its code; everything below it only raises, so tests call it directly.
"""


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
    """Another build holds the lock on the same output directory."""

    exit_code = 7


def run_cli(prog: str, body: Callable[[], int], interrupted: str = "interrupted") -> int:
    """A command-line entry point's frame: FatalError -> its message and exit code; Ctrl-C -> 130."""
    try:
        return body()
    except FatalError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return 130
