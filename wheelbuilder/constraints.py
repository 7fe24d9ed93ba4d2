"""Pip and uv constraints on this machine that can hide the torch a lock asks for.

A machine's pip may carry a site constraints file (PIP_CONSTRAINT, or `constraint = ...` in a pip
configuration file such as /etc/pip.conf) that caps torch below the newest release; uv reads
UV_CONSTRAINT. Such a cap makes an exact pin unresolvable, or makes a `pip install` on that machine
quietly install another torch than the lock's. `make lock` therefore reads every constraint file it can
find before resolving and refuses, naming the file, the line and the way out, when one excludes the
requested torch; after resolving it prints the torch it got (wheelbuilder.lock).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from .errors import ConfigurationError

ENV_VARS = ("PIP_CONSTRAINT", "UV_CONSTRAINT")


@dataclass(frozen=True)
class Constraint:
    """One line of a constraints file that names a package."""

    source: str  # how the file was found: "PIP_CONSTRAINT", "pip config global.constraint", ...
    path: Path
    lineno: int
    requirement: Requirement

    def where(self) -> str:
        return f"{self.path}:{self.lineno} (from {self.source})"


def _split_paths(value: str) -> list[str]:
    # pip splits PIP_CONSTRAINT and a config's `constraint` on whitespace; uv takes one path per entry.
    return [p for p in value.split() if p]


def pip_config_constraints(python: str = sys.executable, env: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """[(source, path)] of `constraint` settings in pip's configuration files, as pip itself reads them
    (`pip config list`: the site, user and global files and PIP_CONFIG_FILE)."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         env=dict(os.environ if env is None else env, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    found = []
    for line in out.stdout.splitlines():  # global.constraint='/etc/pip-constraints.txt'
        key, sep, value = line.partition("=")
        # ":env:.constraint" is PIP_CONSTRAINT again, which constraint_files reads itself.
        if sep and key.strip().endswith(".constraint") and not key.startswith(":env:"):
            for path in _split_paths(value.strip().strip("'\"")):
                found.append((f"pip config {key.strip()}", path))
    return found


def constraint_files(env: dict[str, str] | None = None, python: str = sys.executable) -> list[tuple[str, Path]]:
    """Every constraints file pip or uv would apply here: [(how it was found, path)]."""
    env = dict(os.environ) if env is None else env
    found = [(var, p) for var in ENV_VARS for p in _split_paths(env.get(var, ""))]
    found += pip_config_constraints(python, env)
    return [(source, Path(p).expanduser()) for source, p in found]


def read_constraints(source: str, path: Path, seen: set[Path] | None = None) -> list[Constraint]:
    """The requirement lines of one constraints file, following its own `-c`/`-r` includes."""
    seen = set() if seen is None else seen
    if path.resolve() in seen:
        return []
    seen.add(path.resolve())
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigurationError(
            f"{source} names the constraints file {path}, which cannot be read ({e.strerror or e}). pip would "
            f"fail the same way; fix or unset {source.split()[-1]} before `make lock`.") from None
    found = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        # a trailing comment, and per-requirement options such as `--hash=...` on the same line
        line = raw.split(" #", 1)[0].split(" --", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(("-c ", "-r ", "--constraint ", "--requirement ")):
            included = Path(line.split(None, 1)[1].strip())
            found += read_constraints(f"{path}:{lineno}", path.parent / included, seen)
            continue
        if line.startswith("-"):
            continue  # an option line (--index-url, --hash on its own): no version bound
        try:
            found.append(Constraint(source, path, lineno, Requirement(line.rstrip("\\ "))))
        except InvalidRequirement:
            continue  # pip would refuse the file itself; that is not a torch cap
    return found


def hiding_constraints(package: str, version: str, env: dict[str, str] | None = None,
                       python: str = sys.executable) -> list[Constraint]:
    """The constraints on this machine whose specifier excludes `package==version`."""
    name, wanted = canonicalize_name(package), Version(version)
    hits = []
    for source, path in constraint_files(env, python):
        for c in read_constraints(source, path):
            if canonicalize_name(c.requirement.name) == name and not c.requirement.specifier.contains(wanted, prereleases=True):
                hits.append(c)
    return hits


def refuse_hidden_torch(version: str, pinned_by: str, env: dict[str, str] | None = None,
                        python: str = sys.executable) -> None:
    """Raise ConfigurationError when a pip/uv constraint on this machine excludes torch `version`."""
    hits = hiding_constraints("torch", version, env, python)
    if not hits:
        return
    lines = "; ".join(f"'{c.requirement}' at {c.where()}" for c in hits)
    raise ConfigurationError(
        f"torch {version} ({pinned_by}) is hidden by a constraint on this machine: {lines}. pip (or uv, for "
        "UV_CONSTRAINT) here would install another torch than the lock's, or none. Run `make lock` without it "
        "(unset PIP_CONSTRAINT / UV_CONSTRAINT, or PIP_CONFIG_FILE=/dev/null for a pip.conf setting), or "
        "drop the torch line from that file."
    )
