"""Deterministic wheel archives: same contents in, byte-identical .whl out.

`pip wheel` output varies between two builds of identical files: zip entry order follows the
file system, timestamps are the build time, permission bits follow the umask. `repack_deterministic`
rewrites a wheel with all of that fixed:

    entries     sorted by path; the .dist-info folder last and its RECORD last of all (PEP 427
                recommends dist-info at the end so installers can find it cheaply)
    timestamps  SOURCE_DATE_EPOCH in UTC, clamped to what zip can store (1980-01-01 .. 2107-12-31)
    modes       0644 for files, 0755 for shared objects and .data/scripts (zip "made by" Unix)
    compression DEFLATE at a fixed level (the same zlib gives the same bytes; see KNOWN LIMIT)
    RECORD      regenerated: `path,sha256=<urlsafe base64, no padding>,size`, RECORD itself `RECORD,,`

KNOWN LIMIT: deflate output depends on the zlib build. Two repacks are identical on one builder
image; across different zlib builds (e.g. zlib-ng) the compressed bytes may differ.
Nothing inside the files is changed (shared objects are not stripped).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import re
import time
import zipfile
from pathlib import Path

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from .errors import AuditError, BuildError
from common.fsutil import atomic_write

BUILD_INFO = "wheelbuilder.json"  # written into the dist-info by the build, read back by the audit
COMPRESSLEVEL = 6
ZIP_MIN_EPOCH = 315532800  # 1980-01-01T00:00:00Z: the DOS date in a zip header starts there
ZIP_MAX_EPOCH = 4354819198  # 2107-12-31T23:59:58Z: and ends here
SIGNATURES = ("RECORD.jws", "RECORD.p7s")  # signatures of the old RECORD: invalid after a repack
EXECUTABLE = re.compile(r"(\.so(\.\d+)*$)|(^[^/]+\.data/scripts/)")


def record_hash(data: bytes) -> str:
    """The RECORD spelling of a digest: `sha256=` + urlsafe base64 without padding."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode("ascii")
    return f"sha256={digest}"


def zip_date_time(source_date_epoch: int) -> tuple[int, int, int, int, int, int]:
    """The zip header timestamp for SOURCE_DATE_EPOCH (UTC), clamped into zip's 1980..2107 range."""
    if not isinstance(source_date_epoch, int) or isinstance(source_date_epoch, bool) or source_date_epoch < 0:
        raise BuildError(
            f"SOURCE_DATE_EPOCH must be a non-negative integer of seconds since 1970, not {source_date_epoch!r}; "
            "use e.g. the last commit's time: `git log -1 --format=%ct`."
        )
    clamped = min(max(source_date_epoch, ZIP_MIN_EPOCH), ZIP_MAX_EPOCH)
    return time.gmtime(clamped)[:6]


def dist_info_dir(names: list[str], wheel_name: str) -> str:
    """The wheel's `<name>-<version>.dist-info` folder, checked against the wheel's file name."""
    try:
        name, version, _build, _tags = parse_wheel_filename(wheel_name)
    except InvalidWheelFilename as e:
        raise AuditError(f"{wheel_name} is not a valid wheel file name ({e}); wheel files are named "
                         "<name>-<version>-<python tag>-<abi tag>-<platform tag>.whl.") from None
    found = sorted({n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")})
    matching = [d for d in found if _dist_info_matches(d, name, str(version))]
    if not matching and len(found) == 1:  # one metadata folder, of another name or version: a renamed file
        raise AuditError(
            f"{wheel_name}: the file name does not match the wheel's metadata (its folder is {found[0]}, the name "
            f"asks for {name}-{version}): the file was renamed after the build, and installers refuse it. Give it "
            f"back its own name ({found[0][: -len('.dist-info')]}-<the tags in {found[0]}/WHEEL>.whl), or rebuild "
            "the version its name asks for."
        )
    if len(matching) != 1:
        raise AuditError(
            f"{wheel_name}: expected exactly one {wheel_name.split('-')[0]}-{version}.dist-info folder, found "
            f"{found or 'none'}. The wheel was not built by a PEP 427 backend; rebuild it with `pip wheel`."
        )
    return matching[0]


def _dist_info_matches(folder: str, name, version: str) -> bool:
    stem = folder[: -len(".dist-info")]
    dist, _, ver = stem.rpartition("-")
    return canonicalize_name(dist) == name and ver == version


def read_record(zf: zipfile.ZipFile, dist_info: str) -> dict[str, tuple[str, str]]:
    """RECORD as {path: (hash, size)}; empty when the wheel has none."""
    try:
        text = zf.read(f"{dist_info}/RECORD").decode("utf-8")
    except KeyError:
        return {}
    return {row[0]: (row[1], row[2]) for row in csv.reader(io.StringIO(text)) if row}


def verify_record(wheel: Path | str) -> list[str]:
    """Problems with a wheel's RECORD: files missing from it, listed but absent, wrong hash or size."""
    wheel = Path(wheel)
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if not n.endswith("/")]
        dist_info = dist_info_dir(names, wheel.name)
        record = read_record(zf, dist_info)
        if not record:
            return [f"{dist_info}/RECORD is missing or empty"]
        problems = []
        unhashed = {f"{dist_info}/RECORD"} | {f"{dist_info}/{s}" for s in SIGNATURES}
        for name in names:
            if name not in record:
                problems.append(f"{name} is in the archive but not in RECORD")
            elif name not in unhashed:
                data = zf.read(name)
                want_hash, want_size = record[name]
                if want_hash != record_hash(data) or want_size != str(len(data)):
                    problems.append(f"{name}: RECORD says {want_hash} ({want_size} bytes), content is "
                                    f"{record_hash(data)} ({len(data)} bytes)")
        problems += [f"{n} is in RECORD but not in the archive" for n in record if n not in names]
        return problems


def _archive_order(names: list[str], dist_info: str) -> list[str]:
    """Sorted paths, the dist-info folder last and RECORD the very last entry."""
    record = f"{dist_info}/RECORD"
    return sorted(names, key=lambda n: (n == record, n.startswith(dist_info + "/"), n))


def _zipinfo(name: str, date_time: tuple) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=date_time)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.create_system = 3  # Unix, so the mode bits below are honoured (the default follows the host OS)
    mode = 0o755 if EXECUTABLE.search(name) else 0o644
    info.external_attr = (0o100000 | mode) << 16  # regular file + permission bits
    return info


def _read_contents(src: Path, extra_files: dict[str, bytes]) -> tuple[str, dict[str, bytes]]:
    """The wheel's files (RECORD and its signatures dropped, extra files added to the dist-info),
    after checking every file against the source RECORD, so a damaged input is never re-blessed."""
    with zipfile.ZipFile(src) as zf:
        names = [n for n in zf.namelist() if not n.endswith("/")]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise AuditError(f"{src.name} holds {', '.join(twice)} more than once; which copy an installer "
                             "takes is undefined. The archive was appended to after the build; rebuild it.")
        dist_info = dist_info_dir(names, src.name)
        record = read_record(zf, dist_info)
        skip = {f"{dist_info}/RECORD"} | {f"{dist_info}/{s}" for s in SIGNATURES}
        contents = {}
        for name in names:
            if name in skip:
                continue
            data = zf.read(name)
            listed = record.get(name)
            if listed and listed[0] and listed[0].startswith("sha256=") and listed[0] != record_hash(data):
                raise AuditError(f"{src.name}: {name} does not match its RECORD hash ({listed[0]} vs "
                                 f"{record_hash(data)}); the wheel is damaged, rebuild it.")
            contents[name] = data
    for fname, data in extra_files.items():
        if "/" in fname or fname in ("RECORD", *SIGNATURES) or not fname:
            raise BuildError(f"extra file name '{fname}' is not allowed: give a plain file name (no '/'), "
                             "other than RECORD, to place in the dist-info folder.")
        if not isinstance(data, bytes):
            raise BuildError(f"extra file '{fname}' must be bytes, not {type(data).__name__}; encode it first.")
        contents[f"{dist_info}/{fname}"] = data
    return dist_info, contents


def repack_deterministic(src_wheel: Path | str, dest_dir: Path | str, *, extra_files: dict[str, bytes] | None = None,
                         source_date_epoch: int) -> Path:
    """Rewrite `src_wheel` into `dest_dir` (same file name) as a byte-reproducible archive.

    `extra_files` ({name: bytes}) are added to (or replace files in) the .dist-info folder. The new
    wheel is written to a temporary name in `dest_dir` and moved into place (fsutil.atomic_write), so a
    reader never sees half a wheel. `src_wheel` may be the destination itself. Returns the new path.
    """
    src, dest_dir = Path(src_wheel), Path(dest_dir)
    date_time = zip_date_time(source_date_epoch)
    if not src.is_file():
        raise BuildError(f"wheel {src} does not exist; build it first (pip wheel) or check the path.")
    dist_info, contents = _read_contents(src, dict(extra_files or {}))
    record_name = f"{dist_info}/RECORD"
    rows = [(n, record_hash(contents[n]), str(len(contents[n]))) for n in _archive_order(list(contents), dist_info)]
    rows.append((record_name, "", ""))
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    contents[record_name] = out.getvalue().encode("utf-8")

    archive = io.BytesIO()  # the contents are in memory already; the compressed copy is smaller
    with zipfile.ZipFile(archive, "w") as zf:
        for name in _archive_order(list(contents), dist_info):
            zf.writestr(_zipinfo(name, date_time), contents[name], compresslevel=COMPRESSLEVEL)
    return atomic_write(dest_dir / src.name, archive.getvalue())


def read_build_info(wheel: Path | str) -> dict | None:
    """The dist-info's wheelbuilder.json of a wheel, or None when it has none."""
    wheel = Path(wheel)
    with zipfile.ZipFile(wheel) as zf:
        dist_info = dist_info_dir([n for n in zf.namelist() if not n.endswith("/")], wheel.name)
        try:
            raw = zf.read(f"{dist_info}/{BUILD_INFO}")
        except KeyError:
            return None
    try:
        return json.loads(raw)
    except ValueError as e:
        raise AuditError(f"{wheel.name}: {dist_info}/{BUILD_INFO} is not valid JSON ({e}); "
                         "rebuild the wheel.") from None


def build_info(target, recipe, **more) -> bytes:
    """The wheelbuilder.json bytes for a wheel built for `target` from `recipe` (deterministic JSON).

    Keys: target, torch, cuda, python, arches, recipe {key, name, version, url, sha256}, plus `more`
    (e.g. source_date_epoch). No timestamps: the file must be identical for identical builds.
    """
    info = {
        "target": target.name,
        "torch": target.torch.version,
        "cuda": str(target.torch.cuda),
        "python": target.python,
        "arches": [str(a) for a in target.arches],
        "recipe": {"key": recipe.key, "name": recipe.name, "version": recipe.version,
                   "url": recipe.url, "sha256": recipe.sha256},
        **more,
    }
    return (json.dumps(info, indent=2, sort_keys=True) + "\n").encode("utf-8")
