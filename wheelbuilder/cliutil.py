"""What every console script of the project shares: `--version` and help that shows each default once.

    dflash --version, dflash-train --version, dflash-eval --version, wheelbuilder --version,
    dflash-images --version   ->  "<prog> <version>" of the installed dflash-images distribution
"""

from __future__ import annotations

import argparse
from importlib.metadata import PackageNotFoundError, version

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
