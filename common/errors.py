"""The base of every error of the project's programs, and the exit codes below 8 they share.

Each program keeps one error family with its own codes (wheelbuilder/errors.py 1-7, images/errors.py
8-16, dflash/errors.py 1-10); all of them derive from `FatalError`, so one frame (`common.cli.run_cli`)
turns any of them into its message and exit code. The classes here are the ones the shared primitives
(`common.fsutil`, `common.cmd`) raise:

    1  FatalError          the base: `str()` is the full, user-facing message
    2  ConfigurationError  an option, a file or an environment variable is wrong
    3  ToolchainError      a tool is missing or cannot run
    5  BuildError          a command failed (`common.cmd.run`'s default)
    7  BusyError           another process holds the lock on the same directory
"""


class FatalError(Exception):
    """A failure that stops the command; `str()` is the full, user-facing message."""

    exit_code = 1


class ConfigurationError(FatalError):
    """A command-line option, a configuration file or an environment variable is wrong."""

    exit_code = 2


class ToolchainError(FatalError):
    """A tool the command needs is missing or cannot run (no nvcc, nvcc too old, no skopeo, ...)."""

    exit_code = 3


class BuildError(FatalError):
    """A command (a compile, a docker build) failed; the log file holds the full output."""

    exit_code = 5


class BusyError(FatalError):
    """Another process holds the lock on the same output, build or run directory."""

    exit_code = 7
