"""A checkpoint's manifest: the size and sha256 of every file in it, written last, just before the
rename publishes the checkpoint (dflash.train.records.checkpoint.publish), and compared on --resume before the
target loads (dflash.train.precheck).

safetensors, torch.load and DCP read a file whose bytes changed inside tensor data without an error: a
flipped bit would resume into another drafter with exit 0. The manifest is what catches it.

    checkpoints/step-N/manifest.json   {"files": {"drafter/model.safetensors": {"size": ..., "sha256": ...}, ...}}
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath

from common.fsutil import atomic_write

MANIFEST = "manifest.json"
# the key of trainer_state.pt that says its checkpoint has a manifest (absent from checkpoints written before)
WRITTEN_KEY = "with_manifest"


def file_digests(folder: Path) -> dict[str, dict]:
    """{path relative to `folder`: {"size", "sha256"}} of every file under it but the manifest."""
    digests = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        digests[path.relative_to(folder).as_posix()] = {"size": path.stat().st_size, "sha256": h.hexdigest()}
    return digests


def write_manifest(checkpoint: Path) -> None:
    """Record every file of the complete checkpoint folder `checkpoint` (the last write into it)."""
    atomic_write(checkpoint / MANIFEST, json.dumps({"files": file_digests(checkpoint)}, indent=1) + "\n")


def _shown(value) -> str:
    """A manifest value as JSON, cut short: "116770" (a string) reads apart from 116770."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _entry_problem(name: str, entry) -> str | None:
    """What is wrong with one entry of the manifest's "files" ({"size": bytes, "sha256": 64 hex digits}, named by
    a path relative to the checkpoint, as write_manifest writes it), or None."""
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts or path.as_posix() != name or name == MANIFEST:
        return f"it lists {_shown(name)}, which is not a path inside the checkpoint"
    if not isinstance(entry, dict):
        return f'its entry for {name} is {_shown(entry)}, not {{"size": ..., "sha256": ...}}'
    size, sha = entry.get("size"), entry.get("sha256")
    if type(size) is not int or size < 0:
        return f"its entry for {name} has size {_shown(size)}, not a whole number of bytes"
    if not (isinstance(sha, str) and len(sha) == 64 and set(sha) <= set("0123456789abcdef")):
        return f"its entry for {name} has sha256 {_shown(sha)}, not 64 hexadecimal digits"
    return None


def read_manifest(path: Path) -> dict[str, dict]:
    """The "files" of the manifest at `path`, every entry checked; a ValueError saying what is wrong otherwise."""
    try:
        doc = json.loads(path.read_bytes())
    except json.JSONDecodeError as exc:
        raise ValueError(f"it is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}): cut short "
                         "or overwritten") from None
    except (UnicodeDecodeError, RecursionError):  # not text; brackets nested past the parser's depth
        raise ValueError("it is not the JSON text this trainer writes: overwritten") from None
    except OSError as exc:  # a directory, no permission
        raise ValueError(f"it cannot be read ({exc.strerror or exc})") from None
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict):
        raise ValueError(f'it holds {_shown(doc)}, not {{"files": {{path: {{"size": ..., "sha256": ...}}}}}}')
    for name, entry in sorted(files.items()):
        if problem := _entry_problem(name, entry):
            raise ValueError(problem)
    return files


def check_manifest(checkpoint: Path, required: bool = False) -> tuple[Path, str] | None:
    """(the file, what is wrong with it) for the first problem of `checkpoint` against its manifest: the manifest
    itself damaged (not JSON, wrong types), a file it lists missing or changed, a file it does not list; None
    when all match. A checkpoint written before manifests existed has none: None, unless `required` (its
    trainer state says it was written with one)."""
    path = checkpoint / MANIFEST
    if not (path.exists() or path.is_symlink()):
        return (path, "it is missing, though the checkpoint's trainer state says it was written with one") \
            if required else None
    try:
        recorded = read_manifest(path)
        found = file_digests(checkpoint)
    except ValueError as exc:
        return path, str(exc)
    except OSError as exc:  # a file of the checkpoint that cannot be read
        return Path(exc.filename or checkpoint), f"it cannot be read ({exc.strerror or exc})"
    for name, want in sorted(recorded.items()):
        got = found.get(name)
        if got is None:
            return checkpoint / name, "it is missing; the manifest lists it"
        if got["size"] != want["size"]:
            return checkpoint / name, f"it holds {got['size']} bytes, {want['size']} were written"
        if got["sha256"] != want["sha256"]:
            return checkpoint / name, (f"it changed since it was written (sha256 {got['sha256'][:12]}..., "
                                       f"recorded {want['sha256'][:12]}...)")
    unlisted = sorted(set(found) - set(recorded))
    if unlisted:
        return checkpoint / unlisted[0], ("the manifest does not list it, and it lists every file the checkpoint was "
                                          "written with; if it was put there afterwards, move it out")
    return None
