"""`make wheels-matrix`: every target of targets.toml that builds on this machine, through the builder
stage one after another, then the PEP 503 index of what dist/wheels/ holds.

A target builds here when its locks are committed (a torch from the PyTorch index is locked only where
that index is reachable) and its nvcc is available: NVIDIA's PyPI wheels always are; a devel image
(kind "image") only when the engine already holds it by its pinned digest (`make pin-images` needs a
registry). The others are listed with the reason and the command that makes them buildable. Each build
is the same reproducible builder stage as `make wheels`, so a repeat gives the same bytes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from common.cmd import echo
from common.fsutil import DIST_WHEELS
from wheelbuilder import targets as tg
from wheelbuilder.errors import ConfigurationError


def why_not_buildable(target: tg.Target) -> str | None:
    """None when `target` builds here; else the reason and the way out."""
    from wheelbuilder.lock import require_locks

    try:
        require_locks(target)
    except ConfigurationError:
        return (f"no locks/{target.torch.lock}/ (torch {target.torch.version} from {target.torch.index}): "
                f"`make lock TARGET={target.name}` where that index is reachable")
    if target.toolkit.kind == "image":
        from .engine import image_exists
        from .pin_file import image_pin

        pin = image_pin(target)
        if not pin.digest or not image_exists(f"{pin.repository}@{pin.digest}"):
            return f"nvcc comes from {target.toolkit.image}, not on this engine: `make pin-images` where a registry is reachable"
    return None


def plan(catalog: tg.Catalog, names: list[str] | None = None) -> tuple[list[tg.Target], dict[str, str]]:
    """(targets that build here, {target: why not} for the others), in targets.toml's order."""
    chosen = [catalog.target(n) for n in names] if names else list(catalog.targets.values())
    ready, skipped = [], {}
    for target in chosen:
        reason = why_not_buildable(target)
        if reason:
            skipped[target.name] = reason
        else:
            ready.append(target)
    return ready, skipped


def build_matrix(names: list[str] | None = None, *, dry_run: bool = False, index: bool = True) -> dict:
    """Build every target that builds here; returns {"built": [...], "skipped": {...}} (also printed)."""
    from wheelbuilder.manifest import read_manifest

    from .build import build_wheels

    ready, skipped = plan(tg.load(), names)
    for name, reason in skipped.items():
        echo(f"skip {name}: {reason}")
    built = []
    for target in ready:
        if dry_run:
            echo(f"would build {target.name}")
            continue
        started = time.monotonic()
        out = build_wheels(target)
        for w in read_manifest(out).wheels:
            built.append({"target": target.name, "wheel": w.filename, "sha256": w.sha256, "size": w.size,
                          "seconds": round(time.monotonic() - started, 1)})
    if built and index:
        from wheelbuilder.index import write_index

        write_index(DIST_WHEELS, DIST_WHEELS.parent / "index")
        echo(f"index: {DIST_WHEELS.parent / 'index'} (serve it: python -m http.server -d {DIST_WHEELS.parent / 'index'})")
    return {"built": built, "skipped": skipped}


def register(sub) -> None:
    import argparse

    p = sub.add_parser("wheels-matrix", help="build every target's wheels that builds here, then write dist/index",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--targets", default="", help="comma-separated targets (default: all of targets.toml)")
    p.add_argument("--dry-run", action="store_true", help="say what would be built and what is skipped, and why")
    p.add_argument("--no-index", action="store_true", help="do not write dist/index afterwards")
    p.add_argument("--json", type=Path, default=None, help="also write the result (wheels, sha256, seconds) here")
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    names = [n.strip() for n in args.targets.split(",") if n.strip()] or None
    result = build_matrix(names, dry_run=args.dry_run, index=not args.no_index)
    for row in result["built"]:
        print(f"{row['target']:<24} {row['seconds']:>7.1f} s  {row['sha256']}  {row['wheel']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
