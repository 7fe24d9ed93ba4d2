"""manifest.json beside the wheels in dist/wheels/<target>/: what each wheel is, and proof it is intact.

    dist/wheels/cu130-sm120/
        causal_conv1d-1.7.0+cu130torch2.11sm120-cp311-cp311-linux_x86_64.whl
        manifest.json     {"format": 1, "wheels": [{filename, size, sha256, recipe, ..., arches, toolchain}]}

The build adds one entry per wheel (`write_manifest`, merged with what is there); the runtime image
build refuses wheels that do not match it (`verify_wheels`, or `python -m wheelbuilder verify --dir DIR`).
The file is deterministic: sorted keys, wheels sorted by file name, no time stamps beyond the
recorded build time and SOURCE_DATE_EPOCH; it is replaced atomically (temp file + os.replace).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .errors import AuditError, BuildError
from common.fsutil import atomic_write, sha256_file

MANIFEST = "manifest.json"
FORMAT = 1
_SHA256 = re.compile(r"[0-9a-f]{64}")
# The JSON types of a wheel entry's scalar fields, checked when a manifest is read.
ENTRY_TYPES = {"filename": str, "size": int, "sha256": str, "recipe": str, "recipe_version": str,
               "source_url": str, "source_sha256": str, "target": str, "arches": dict,
               "build_seconds": (int, float), "source_date_epoch": int}


@dataclass(frozen=True)
class ToolchainRecord:
    """Versions of what built the wheel, as recorded in the manifest (strings as the tools print them)."""

    nvcc: str  # "13.0.88"
    torch: str  # "2.11.0"
    python: str  # "3.11.2"
    host_compiler: str  # "gcc 12.2.0"
    # {package: version} of the compiler and headers from the distribution (toolkit.system_packages)
    system_packages: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class WheelEntry:
    """One wheel in the manifest."""

    filename: str  # the .whl file name, in the manifest's folder
    size: int  # bytes
    sha256: str  # hex digest of the .whl file
    recipe: str  # recipe name in targets.toml, e.g. "causal-conv1d"
    recipe_version: str  # upstream version built, e.g. "1.7.0"
    source_url: str  # the pinned sdist
    source_sha256: str  # its hex sha256
    target: str  # target name, e.g. "cu130-sm120"
    arches: dict[str, list[int]]  # found by the audit: {"sass": [120], "ptx": []}
    toolchain: ToolchainRecord
    build_seconds: float  # wall time of the compile
    source_date_epoch: int  # the zip timestamps of the wheel (seconds since 1970)

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "WheelEntry":
        if not isinstance(d, dict):
            raise AuditError(f"{where}: a wheel entry is {type(d).__name__} {str(d)[:60]!r}, not an object with "
                             "filename, size, sha256, ...; the manifest was edited by hand or damaged. Delete it "
                             "and rebuild the wheels (make wheels).")
        names = {f.name for f in fields(cls)}
        missing, unknown = names - d.keys(), d.keys() - names
        if missing or unknown:
            raise AuditError(
                f"{where}: a wheel entry has missing keys {sorted(missing)} / unknown keys {sorted(unknown)}. "
                "The manifest was written by another version or edited by hand; rebuild the wheels (make wheels)."
            )
        wrong = [f"{k} is {type(d[k]).__name__}, not {getattr(t, '__name__', 'a number')}"
                 for k, t in ENTRY_TYPES.items()
                 if not isinstance(d[k], t) or isinstance(d[k], bool)]
        if not wrong and (not _SHA256.fullmatch(d["sha256"]) or "/" in d["filename"] or d["filename"] in ("", ".", "..")
                          or d["size"] < 0):
            wrong = [f"filename {d['filename']!r}, size {d['size']}, sha256 {d['sha256'][:70]!r} are not a plain file "
                     "name, a byte count and 64 hex digits"]
        if wrong:
            raise AuditError(f"{where}: wheel entry {str(d.get('filename'))[:80]!r}: {'; '.join(wrong)}. The manifest "
                             "was edited by hand or damaged; delete it and rebuild the wheels (make wheels).")
        if not isinstance(d["toolchain"], dict):
            raise AuditError(f"{where}: toolchain record is {type(d['toolchain']).__name__}, not an object; "
                             "rebuild the wheels (make wheels).")
        try:
            return cls(**{**d, "toolchain": ToolchainRecord(**d["toolchain"])})
        except TypeError as e:
            raise AuditError(f"{where}: toolchain record is malformed ({e}); "
                             "rebuild the wheels (make wheels).") from None


@dataclass(frozen=True)
class Manifest:
    wheels: tuple[WheelEntry, ...] = field(default_factory=tuple)

    def to_json(self) -> str:
        data = {"format": FORMAT, "wheels": [asdict(w) for w in sorted(self.wheels, key=lambda w: w.filename)]}
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    def by_filename(self) -> dict[str, WheelEntry]:
        return {w.filename: w for w in self.wheels}


def entry_for(wheel: Path | str, **fields_) -> WheelEntry:
    """A WheelEntry for a wheel on disk: filename, size and sha256 come from the file itself."""
    wheel = Path(wheel)
    return WheelEntry(filename=wheel.name, size=wheel.stat().st_size, sha256=sha256_file(wheel), **fields_)


def read_manifest(directory: Path | str) -> Manifest:
    """Load `<directory>/manifest.json`; a missing or malformed file is an AuditError saying what to do."""
    path = Path(directory) / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AuditError(f"{path} does not exist: these wheels were not built by `make wheels` "
                         "(or the build did not finish); run it for this target.") from None
    except ValueError as e:
        raise AuditError(f"{path} is not valid JSON ({e}); delete it and rebuild the wheels (make wheels).") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("wheels"), list):
        raise AuditError(f"{path}: expected {{'format': {FORMAT}, 'wheels': [...]}}, found format "
                         f"{data.get('format') if isinstance(data, dict) else type(data).__name__}; "
                         "rebuild the wheels with this version of wheelbuilder (make wheels).")
    return Manifest(tuple(WheelEntry.from_dict(w, str(path)) for w in data["wheels"]))


def _check_entry_matches_file(directory: Path, entry: WheelEntry) -> None:
    wheel = directory / entry.filename
    if not wheel.is_file():
        raise BuildError(f"manifest entry for {entry.filename}, but no such wheel in {directory}; "
                         "write the wheel into that folder before recording it.")
    size, sha = wheel.stat().st_size, sha256_file(wheel)
    if (size, sha) != (entry.size, entry.sha256):
        raise BuildError(f"manifest entry for {entry.filename} says {entry.size} bytes sha256 {entry.sha256}, "
                         f"the file is {size} bytes sha256 {sha}; record the wheel after its final repack "
                         "(use manifest.entry_for).")


def write_manifest(directory: Path | str, entries) -> Path:
    """Add or replace `entries` (WheelEntry) in `<directory>/manifest.json`, keeping the other wheels'
    entries whose files are still there (an entry for a deleted wheel is stale and dropped).

    Each new entry must match its file's size and sha256 (checked first: nothing is written otherwise).
    """
    directory = Path(directory)
    entries = list(entries)
    for e in entries:
        _check_entry_matches_file(directory, e)
    merged = read_manifest(directory).by_filename() if (directory / MANIFEST).exists() else {}
    merged = {name: w for name, w in merged.items() if (directory / name).is_file()}
    merged.update({e.filename: e for e in entries})
    text = Manifest(tuple(merged.values())).to_json()

    return atomic_write(directory / MANIFEST, text)


def verify_wheels(directory: Path | str) -> list[str]:
    """Problems that make the folder's wheels untrustworthy (empty list: all good): a missing or
    unreadable manifest, a listed wheel missing or with another size/sha256, a .whl nobody listed."""
    directory = Path(directory)
    try:
        manifest = read_manifest(directory)
    except AuditError as e:
        return [str(e)]
    problems = []
    if not manifest.wheels:
        problems.append(f"{directory / MANIFEST} lists no wheels; build them with `make wheels`.")
    for w in manifest.wheels:
        wheel = directory / w.filename
        if not wheel.is_file():
            problems.append(f"{w.filename} is listed in {MANIFEST} but missing from {directory}; "
                            "rebuild it (make wheels).")
            continue
        size, sha = wheel.stat().st_size, sha256_file(wheel)
        if (size, sha) != (w.size, w.sha256):
            problems.append(f"{w.filename}: {MANIFEST} records {w.size} bytes sha256 {w.sha256}, the file is "
                            f"{size} bytes sha256 {sha}: it changed after the build; rebuild it (make wheels).")
    listed = manifest.by_filename()
    for extra in sorted(p.name for p in directory.glob("*.whl") if p.name not in listed):
        problems.append(f"{extra} is in {directory} but not in {MANIFEST}; remove it or rebuild (make wheels).")
    return problems
