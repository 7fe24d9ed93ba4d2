"""A target as the command line changes it: `--arch 9.0,12.0` (other arches, checked as targets.toml's
are) and `--python 3.12` (a native build for another CPython; the wheel's cp tag follows it)."""

from __future__ import annotations

import dataclasses
import re

from packaging.version import Version

from .errors import ConfigurationError
from .targets import Arch, Target, check_arches_compilable, check_unique_arches


def with_arches(target: Target, arch_text: str) -> Target:
    """The same target with its arches overridden from a command line (`--arch 9.0,12.0`)."""
    arches = tuple(Arch.parse(a) for a in arch_text.split(",") if a.strip())
    if not arches:
        raise ConfigurationError(f"--arch {arch_text!r} names no arch; name at least one (e.g. --arch 12.0), "
                                 "or leave --arch out to build the target's own arches.")
    check_unique_arches(arches, f"--arch {arch_text}")
    check_arches_compilable(arches, target.toolkit.cuda, f"--arch {arch_text}")
    return dataclasses.replace(target, arches=arches)


def with_python(target: Target, python: str) -> Target:
    """The same target for another CPython (`--python 3.12`): a native build for a machine whose
    interpreter differs from the toolkit's (the image's) Python. The wheel's cp tag follows it."""
    if not re.fullmatch(r"3\.\d{1,2}", python.strip()):
        raise ConfigurationError(f"--python {python!r} is not a CPython version like 3.12; name major.minor.")
    python = python.strip()
    if Version(python) < Version("3.10"):
        raise ConfigurationError(f"--python {python}: torch {target.torch.version} needs Python >= 3.10; name a newer one.")
    return dataclasses.replace(target, toolkit=dataclasses.replace(target.toolkit, python=python))
