"""The command-line frame every console script of the project shares.

- `run_cli`: the one entry-point frame. A FatalError (any program's error family) becomes its message
  and exit code; Ctrl-C exits 130; SIGTERM raises `Terminated` in the main thread, which unwinds like
  Ctrl-C (child process groups are killed, staging folders removed, atomic writes abandoned) and exits 143.
- `--version` and help that shows each default once:

    dflash --version, dflash-train --version, dflash-eval --version, wheelbuilder --version,
    dflash-images --version   ->  "<prog> <version>" of the installed dflash-images distribution
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

from .errors import FatalError

DISTRIBUTION = "dflash-images"


def project_version() -> str:
    """The installed distribution's version (importlib.metadata); the source tree's when not installed."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        from . import __version__

        return f"{__version__} (source tree, not installed)"


def add_version(parser: argparse.ArgumentParser, name: str | None = None) -> None:
    """`--version`: print "<name or prog> <version>" and exit 0."""
    parser.add_argument("--version", action="version", version=f"{name or '%(prog)s'} {project_version()}")


class DefaultsOnceHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """ArgumentDefaultsHelpFormatter that leaves alone a help text which already says its default
    ("(default: the tokenizer's)"), instead of appending a second "(default: None)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "(default:" in help_text:
            return help_text
        return super()._get_help_string(action)


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
    finally:  # what the body set for itself stays (a stopped training rank ignores SIGTERM until it exits)
        if previous is not None and signal.getsignal(signal.SIGTERM) is _raise_terminated:
            signal.signal(signal.SIGTERM, previous)
