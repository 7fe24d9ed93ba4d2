"""A PEP 503 simple index written from dist/wheels/: pip installs from it through any static file server.

    dist/index/
        files/<wheel>                                   each verified wheel, once
        simple/index.html                               every project (all targets)
        simple/causal-conv1d/index.html                 every wheel of it, each link with #sha256=
        <target>/simple/index.html                      one target's wheels alone: the URL a user
        <target>/simple/causal-conv1d/index.html        gives pip, as with the PyTorch index's /cu130
        index.json                                      what the index holds (target, file, size, sha256)

pip picks the highest version it finds, and the local label (`+cu130torch2.14sm120`) orders the wheels
of one release by torch line, not by the user's torch. So the per-target URL is the one to install
from (`pip install causal-conv1d --index-url <root>/cu130-sm120-torch2.14/simple`); the combined
/simple serves an exact pin (`causal-conv1d==1.7.0+cu130torch2.14sm120`).

Only wheels whose folder's manifest.json verifies (size and sha256) go in; the pages are sorted and
carry no time stamps, so the same dist/ writes the same bytes. The index is written beside `out` and
renamed into place, so a server never sees it half-written.
"""

from __future__ import annotations

import html
import json
import os
import shutil
import tempfile
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

from .errors import ConfigurationError
from .manifest import MANIFEST, read_manifest, verify_wheels

PAGE = "<!DOCTYPE html>\n<html>\n<head><meta name=\"pypi:repository-version\" content=\"1.0\">" \
       "<title>{title}</title></head>\n<body>\n<h1>{title}</h1>\n{links}</body>\n</html>\n"


def _page(title: str, links: list[tuple[str, str]]) -> str:
    body = "".join(f'<a href="{html.escape(href)}">{html.escape(text)}</a><br>\n' for href, text in links)
    return PAGE.format(title=html.escape(title), links=body)


def collect(wheels_root: Path) -> list[dict]:
    """[{target, filename, path, size, sha256, project}] of every verified wheel under
    wheels_root/<target>/, sorted; a folder whose manifest does not verify stops the index."""
    if not wheels_root.is_dir():
        raise ConfigurationError(f"{wheels_root} does not exist: no wheels to index. Build some first "
                                 "(`make wheels TARGET=<target>` or `make wheels-matrix`).")
    rows = []
    for folder in sorted(p for p in wheels_root.iterdir() if (p / MANIFEST).is_file()):
        problems = verify_wheels(folder)
        if problems:  # each a sentence of its own (with what to do about it): listed, not nested in another
            found = " ".join(p if p.endswith(".") else f"{p}." for p in problems)
            raise ConfigurationError(f"{folder} cannot go into the index: {found} For this folder that build is "
                                     f"`make wheels TARGET={folder.name}`; or remove the folder to index the others.")
        for w in read_manifest(folder).wheels:
            name = parse_wheel_filename(w.filename)[0]
            rows.append({"target": w.target, "filename": w.filename, "path": folder / w.filename,
                         "size": w.size, "sha256": w.sha256, "project": canonicalize_name(name)})
    if not rows:
        raise ConfigurationError(f"{wheels_root} holds no folder with a {MANIFEST}: nothing to index. Build "
                                 "wheels first (`make wheels TARGET=<target>` or `make wheels-matrix`).")
    return sorted(rows, key=lambda r: (r["target"], r["filename"]))


def _write_simple(root: Path, rows: list[dict], up: str) -> None:
    """root/index.html and root/<project>/index.html; `up` leads from a project page to the index root."""
    projects = sorted({r["project"] for r in rows})
    root.mkdir(parents=True)
    (root / "index.html").write_text(_page("Simple index", [(f"{p}/", p) for p in projects]))
    for project in projects:
        files = sorted({r["filename"]: r for r in rows if r["project"] == project}.values(), key=lambda r: r["filename"])
        (root / project).mkdir()
        links = [(f"{up}files/{r['filename']}#sha256={r['sha256']}", r["filename"]) for r in files]
        (root / project / "index.html").write_text(_page(f"Links for {project}", links))


def write_index(wheels_root: Path, out: Path) -> dict:
    """Write the index for every verified wheel under wheels_root into `out`; returns index.json's data."""
    rows = collect(wheels_root)
    names: dict[str, dict] = {}
    for r in rows:  # one file name, two different wheels: the index could serve only one of them
        if r["filename"] in names and names[r["filename"]]["sha256"] != r["sha256"]:
            raise ConfigurationError(f"{r['filename']} is in {names[r['filename']]['target']} and {r['target']} "
                                     "with different contents; rebuild one of the two targets.")
        names[r["filename"]] = r
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".index-", dir=out.parent))
    try:
        (stage / "files").mkdir()
        for r in names.values():
            shutil.copyfile(r["path"], stage / "files" / r["filename"])
        _write_simple(stage / "simple", rows, "../../")
        for target in sorted({r["target"] for r in rows}):
            _write_simple(stage / target / "simple", [r for r in rows if r["target"] == target], "../../../")
        record = {"format": 1, "wheels": [{k: r[k] for k in ("target", "filename", "size", "sha256")} for r in rows]}
        (stage / "index.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        for path in [stage, *stage.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        old = out.with_name(f".{out.name}.old")
        if out.exists():
            os.replace(out, old)
        os.replace(stage, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return record
