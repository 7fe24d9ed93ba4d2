"""The serving engines' released wheels for the `serving` test tier: fetched once, sha256-checked, cached.

The pins (tests/data/serving/engine-pins.txt) are a pip requirements file with hashes: one
`name==version --hash=sha256:...` line per wheel. pip fetches exactly those files (no dependencies,
binary only, for CPython 3.11 on manylinux x86_64, whatever machine runs the tests) into the cache:

    $XDG_CACHE_HOME/dflash-images/wheels   (~/.cache/dflash-images/wheels; DFLASH_WHEEL_CACHE overrides)

and every wheel's sha256 is checked again on each use. Nothing is installed: the tests read modules out
of the wheel files (tests.support.engine_import_double).

    python -m tests.support.serving_wheels      fetch the pinned wheels now (what the tier's skip names)
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PINS = Path(__file__).resolve().parents[1] / "data" / "serving" / "engine-pins.txt"
FETCH_COMMAND = f"{Path(sys.executable).name} -m tests.support.serving_wheels"
_PIN = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+)==(?P<version>\S+)\s+--hash=sha256:(?P<sha>[0-9a-f]{64})\s*$")
# The platform the pinned files were built for: SGLang ships CPython-version-specific wheels.
_PLATFORM = ["--python-version", "3.11", "--platform", "manylinux_2_34_x86_64", "--platform",
             "manylinux_2_28_x86_64", "--only-binary=:all:"]


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    sha256: str


def pins() -> dict[str, Pin]:
    """name -> Pin, from the pins file (comments and blank lines ignored)."""
    out = {}
    for line in PINS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = _PIN.match(line)
        if not m:
            raise ValueError(f"{PINS}: bad pin line {line!r}; expected name==version --hash=sha256:<64 hex>")
        out[m["name"]] = Pin(m["name"], m["version"], m["sha"])
    return out


def cache_dir() -> Path:
    if os.environ.get("DFLASH_WHEEL_CACHE"):
        return Path(os.environ["DFLASH_WHEEL_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dflash-images" / "wheels"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _cached(pin: Pin, directory: Path) -> Path | None:
    prefix = f"{pin.name.replace('-', '_')}-{pin.version}-"
    for path in sorted(directory.glob("*.whl")):
        if path.name.startswith(prefix) and _sha256(path) == pin.sha256:
            return path
    return None


def wheel(name: str) -> Path:
    """The pinned wheel of `name`, fetched into the cache when it is not there; raises RuntimeError
    saying why when it cannot be had."""
    pin = pins()[name]
    directory = cache_dir()
    found = _cached(pin, directory)
    if found:
        return found
    directory.mkdir(parents=True, exist_ok=True)
    requirement = directory / f".{pin.name}.pin.txt"
    requirement.write_text(f"{pin.name}=={pin.version} --hash=sha256:{pin.sha256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--quiet",
           "--disable-pip-version-check", *_PLATFORM, "-d", str(directory), "-r", str(requirement)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"pip download {pin.name}=={pin.version} failed: {exc}") from None
    found = _cached(pin, directory)
    if done.returncode != 0 or not found:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"pip download {pin.name}=={pin.version} (sha256 {pin.sha256[:12]}...) failed: {tail}")
    return found


def all_wheels() -> dict[str, Path]:
    return {name: wheel(name) for name in pins()}


if __name__ == "__main__":
    for name, path in all_wheels().items():
        print(f"{name}: {path}")
