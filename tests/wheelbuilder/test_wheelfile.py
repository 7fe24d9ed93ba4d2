"""wheelbuilder.wheelfile: byte-identical repacks, a correct RECORD, atomic writes (fast, no nvcc)."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from wheelbuilder.errors import AuditError, BuildError
from common.fsutil import sha256_file
from wheelbuilder.targets import load
from wheelbuilder.wheelfile import (BUILD_INFO, build_info, read_build_info, record_hash, repack_deterministic,
                                    verify_record, zip_date_time)

NAME = "dummy_pkg-1.0-py3-none-any.whl"
DIST_INFO = "dummy_pkg-1.0.dist-info"
FILES = {
    "dummy_pkg/__init__.py": b"VALUE = 42\n",
    "dummy_pkg/_ext.cpython-311-x86_64-linux-gnu.so": b"\x7fELF not really a library",
    "dummy_pkg/data/table.txt": b"a,b\n1,2\n",
    f"{DIST_INFO}/METADATA": b"Metadata-Version: 2.1\nName: dummy-pkg\nVersion: 1.0\n",
    f"{DIST_INFO}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
EPOCH = 1_700_000_000


def write_source_wheel(path: Path, order: list[str], date_time: tuple, mode: int = 0o664, record: bool = True) -> Path:
    """A wheel as a build backend might write it: any entry order, any time stamps and modes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(zipfile.ZipInfo("dummy_pkg/", date_time), b"")  # a directory entry, as some tools write
        for name in order:
            info = zipfile.ZipInfo(name, date_time)
            info.external_attr = (0o100000 | mode) << 16
            zf.writestr(info, FILES[name], compress_type=zipfile.ZIP_DEFLATED, compresslevel=1)
        if record:
            rows = [(n, record_hash(FILES[n]), len(FILES[n])) for n in order] + [(f"{DIST_INFO}/RECORD", "", "")]
            out = io.StringIO()
            csv.writer(out).writerows(rows)
            zf.writestr(zipfile.ZipInfo(f"{DIST_INFO}/RECORD", date_time), out.getvalue())
    return path


@pytest.fixture
def two_sources(tmp_path) -> tuple[Path, Path]:
    names = list(FILES)
    a = write_source_wheel(tmp_path / "a" / NAME, names, (2024, 5, 1, 10, 0, 0), mode=0o600)
    b = write_source_wheel(tmp_path / "b" / NAME, names[::-1], (2021, 1, 2, 3, 4, 6), mode=0o777, record=False)
    return a, b


def test_same_content_gives_identical_bytes(two_sources, tmp_path):
    a, b = two_sources
    assert sha256_file(a) != sha256_file(b)
    extra = {BUILD_INFO: b'{"torch": "2.11.0"}\n'}
    out_a = repack_deterministic(a, tmp_path / "out_a", extra_files=extra, source_date_epoch=EPOCH)
    out_b = repack_deterministic(b, tmp_path / "out_b", extra_files=extra, source_date_epoch=EPOCH)
    assert out_a.name == out_b.name == NAME
    assert sha256_file(out_a) == sha256_file(out_b)
    # repacking a repacked wheel changes nothing
    again = repack_deterministic(out_a, tmp_path / "again", extra_files=extra, source_date_epoch=EPOCH)
    assert again.read_bytes() == out_a.read_bytes()
    # a different epoch or content gives a different archive
    other = repack_deterministic(a, tmp_path / "other", extra_files=extra, source_date_epoch=EPOCH + 10)
    assert sha256_file(other) != sha256_file(out_a)


def test_layout_timestamps_and_modes(two_sources, tmp_path):
    out = repack_deterministic(two_sources[0], tmp_path, extra_files={"extra.txt": b"x"}, source_date_epoch=EPOCH)
    with zipfile.ZipFile(out) as zf:
        infos = zf.infolist()
    names = [i.filename for i in infos]
    # payload sorted first, then the dist-info sorted, RECORD last; no directory entries
    payload = [n for n in names if not n.startswith(DIST_INFO)]
    assert payload == sorted(payload) and "dummy_pkg/" not in names
    assert names[len(payload):] == sorted(names[len(payload):-1]) + [f"{DIST_INFO}/RECORD"]
    assert f"{DIST_INFO}/extra.txt" in names
    assert {i.date_time for i in infos} == {(2023, 11, 14, 22, 13, 20)}  # EPOCH in UTC
    modes = {i.filename: (i.external_attr >> 16) & 0o777 for i in infos}
    assert modes["dummy_pkg/_ext.cpython-311-x86_64-linux-gnu.so"] == 0o755
    assert {m for n, m in modes.items() if not n.endswith(".so")} == {0o644}
    assert {i.compress_type for i in infos} == {zipfile.ZIP_DEFLATED} and {i.create_system for i in infos} == {3}


def test_record_is_complete_and_correct(two_sources, tmp_path):
    out = repack_deterministic(two_sources[1], tmp_path, extra_files={}, source_date_epoch=EPOCH)
    assert verify_record(out) == []
    with zipfile.ZipFile(out) as zf:
        rows = list(csv.reader(io.StringIO(zf.read(f"{DIST_INFO}/RECORD").decode())))
    assert rows[-1] == [f"{DIST_INFO}/RECORD", "", ""]
    init = next(r for r in rows if r[0] == "dummy_pkg/__init__.py")
    digest = base64.urlsafe_b64encode(hashlib.sha256(FILES[init[0]]).digest()).rstrip(b"=").decode()
    assert init[1] == f"sha256={digest}"
    assert not init[1].endswith("=") and init[2] == str(len(FILES[init[0]]))


def test_pip_installs_the_repacked_wheel(two_sources, tmp_path):
    out = repack_deterministic(two_sources[0], tmp_path / "dist", extra_files={BUILD_INFO: b"{}"},
                               source_date_epoch=EPOCH)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check",
                    "--quiet", "--target", str(target), str(out)], check=True)
    assert (target / "dummy_pkg" / "__init__.py").read_bytes() == FILES["dummy_pkg/__init__.py"]
    assert (target / DIST_INFO / BUILD_INFO).read_bytes() == b"{}"


def test_epoch_is_clamped_to_what_zip_can_store():
    assert zip_date_time(0) == (1980, 1, 1, 0, 0, 0)
    assert zip_date_time(10**11)[0] == 2107
    for bad in (-1, "1700000000", 1.5, None):
        with pytest.raises(BuildError, match="SOURCE_DATE_EPOCH"):
            zip_date_time(bad)


def test_in_place_repack_is_atomic_and_leaves_no_temp_files(two_sources, tmp_path):
    src = two_sources[0]
    out = repack_deterministic(src, src.parent, extra_files={}, source_date_epoch=EPOCH)
    assert out == src and verify_record(out) == []
    before = out.read_bytes()
    with pytest.raises(BuildError, match="not allowed"):
        repack_deterministic(out, out.parent, extra_files={"../evil": b"x"}, source_date_epoch=EPOCH)
    assert out.read_bytes() == before
    assert sorted(p.name for p in out.parent.iterdir()) == [NAME]


@pytest.mark.filterwarnings("ignore:Duplicate name")
def test_damaged_or_misnamed_input_is_refused(tmp_path):
    src = write_source_wheel(tmp_path / "src" / NAME, list(FILES), (2024, 1, 1, 0, 0, 0))
    with zipfile.ZipFile(src, "a") as zf:  # a second copy of a file: ambiguous for an installer
        zf.writestr("dummy_pkg/__init__.py", b"VALUE = 43\n")
    with pytest.raises(AuditError, match="more than once"):
        repack_deterministic(src, tmp_path / "out", extra_files={}, source_date_epoch=EPOCH)
    edited = tmp_path / "edited" / NAME
    edited.parent.mkdir()
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(edited, "w") as zout:  # one file changed, RECORD kept
        for info in zin.infolist()[:-1]:
            data = b"VALUE = 43\n" if info.filename == "dummy_pkg/__init__.py" else zin.read(info)
            zout.writestr(info.filename, data)
    with pytest.raises(AuditError, match="does not match its RECORD hash"):
        repack_deterministic(edited, tmp_path / "out", extra_files={}, source_date_epoch=EPOCH)
    renamed = tmp_path / "other_pkg-1.0-py3-none-any.whl"
    write_source_wheel(renamed, list(FILES), (2024, 1, 1, 0, 0, 0))
    with pytest.raises(AuditError, match="the file name does not match the wheel's metadata .*renamed"):
        repack_deterministic(renamed, tmp_path / "out", extra_files={}, source_date_epoch=EPOCH)
    with pytest.raises(BuildError, match="does not exist"):
        repack_deterministic(tmp_path / NAME, tmp_path / "out", extra_files={}, source_date_epoch=EPOCH)


def test_verify_record_names_each_problem(two_sources, tmp_path):
    out = repack_deterministic(two_sources[0], tmp_path, extra_files={}, source_date_epoch=EPOCH)
    with zipfile.ZipFile(out, "a") as zf:
        zf.writestr("dummy_pkg/sneaked_in.py", b"print('hi')\n")
    assert verify_record(out) == ["dummy_pkg/sneaked_in.py is in the archive but not in RECORD"]


def test_build_info_round_trip(two_sources, tmp_path):
    catalog = load()
    target = catalog.target("cu130-sm120")
    info = build_info(target, target.recipes[0], source_date_epoch=EPOCH)
    assert info == build_info(target, target.recipes[0], source_date_epoch=EPOCH)  # deterministic
    out = repack_deterministic(two_sources[0], tmp_path, extra_files={BUILD_INFO: info}, source_date_epoch=EPOCH)
    got = read_build_info(out)
    assert got == json.loads(info)
    assert got["torch"] == "2.11.0" and got["arches"] == ["12.0"] and got["recipe"]["version"] == "1.7.0"
    assert read_build_info(two_sources[0]) is None


def test_a_failed_write_leaves_the_old_wheel_whole(two_sources, tmp_path, monkeypatch):
    out = repack_deterministic(two_sources[0], tmp_path / "dist", extra_files={}, source_date_epoch=EPOCH)
    before = out.read_bytes()

    def disk_full(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("common.fsutil.os.replace", disk_full)
    with pytest.raises(OSError, match="No space left"):
        repack_deterministic(two_sources[1], out.parent, extra_files={"x": b"1"}, source_date_epoch=EPOCH)
    assert out.read_bytes() == before and [p.name for p in out.parent.iterdir()] == [NAME]
