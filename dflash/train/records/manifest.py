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
from pathlib import Path

from common.fsutil import atomic_write

MANIFEST = "manifest.json"


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


def check_manifest(checkpoint: Path) -> tuple[Path, str] | None:
    """(the file, what is wrong with it) for the first file of `checkpoint` that is missing or differs from its
    manifest, or None when all match. A checkpoint written before manifests existed has none: None."""
    path = checkpoint / MANIFEST
    if not path.exists():
        return None
    try:
        recorded = json.loads(path.read_text())["files"]
        assert isinstance(recorded, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return path, "it does not parse as the manifest this trainer writes"
    found = file_digests(checkpoint)
    for name, want in sorted(recorded.items()):
        got = found.get(name)
        if got is None:
            return checkpoint / name, "it is missing; the manifest lists it"
        if got["size"] != want.get("size"):
            return checkpoint / name, f"it holds {got['size']} bytes, {want.get('size')} were written"
        if got["sha256"] != want.get("sha256"):
            return checkpoint / name, (f"it changed since it was written (sha256 {got['sha256'][:12]}..., "
                                       f"recorded {str(want.get('sha256'))[:12]}...)")
    return None
