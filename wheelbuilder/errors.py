"""wheelbuilder's errors, one type per failure class, each with its own exit code (cibuildwheel's pattern).

Messages say what failed, the values seen, and what to do next. `__main__.main()` runs under
`common.cli.run_cli`, which catches FatalError, prints it and exits with its code; everything below it
only raises, so tests call it directly.

    1 FatalError  2 configuration  3 toolchain  4 source  5 build  6 audit  7 busy (lock held)
    130 Ctrl-C (SIGINT)  143 SIGTERM: both stop the child processes (their whole process group) and
        remove the staging folder; nothing half-written is left in the output directory.

Codes 1, 2, 3, 5 and 7 are the shared ones of `common.errors` (the file-system primitives and the
subprocess wrapper raise them); 4 and 6 are wheelbuilder's own.
"""

from common.errors import BuildError, BusyError, ConfigurationError, FatalError, ToolchainError

__all__ = ["AuditError", "BuildError", "BusyError", "ConfigurationError", "FatalError", "SourceError",
           "ToolchainError"]


class SourceError(FatalError):
    """The pinned source is unavailable or does not match its sha256, or a recipe patch no longer applies."""

    exit_code = 4


class AuditError(FatalError):
    """A built wheel failed its audit; it was not written to dist/."""

    exit_code = 6
