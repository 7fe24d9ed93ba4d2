"""wheelbuilder.manifest: round trip, merge, deterministic and atomic writes, tamper detection (fast)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from wheelbuilder.__main__ import main_inner as wheelbuilder_cli
from wheelbuilder.errors import AuditError, BuildError, FatalError
from wheelbuilder.manifest import (MANIFEST, Manifest, ToolchainRecord, entry_for, read_manifest, verify_wheels,
                                   write_manifest)

TOOLCHAIN = ToolchainRecord(nvcc="13.0.88", torch="2.11.0", python="3.11.2", host_compiler="gcc 12.2.0")


def make_entry(folder: Path, filename: str, payload: bytes = b"wheel bytes", recipe: str = "causal-conv1d"):
    """A wheel file on disk (any bytes do: the manifest only hashes it) and its entry."""
    (folder / filename).write_bytes(payload)
    return entry_for(folder / filename, recipe=recipe, recipe_version="1.7.0",
                     source_url="https://files.pythonhosted.org/packages/x/causal_conv1d-1.7.0.tar.gz",
                     source_sha256="ab" * 32, target="cu130-sm120", arches={"sass": [120], "ptx": []},
                     toolchain=TOOLCHAIN, build_seconds=335.2, source_date_epoch=1_700_000_000)


A = "causal_conv1d-1.7.0+cu130torch2.11sm120-cp311-cp311-linux_x86_64.whl"
B = "other_ext-0.1+cu130torch2.11sm120-cp311-cp311-linux_x86_64.whl"


def test_round_trip(tmp_path):
    entry = make_entry(tmp_path, A)
    assert entry.size == len(b"wheel bytes") and len(entry.sha256) == 64
    write_manifest(tmp_path, [entry])
    assert read_manifest(tmp_path) == Manifest((entry,))
    assert verify_wheels(tmp_path) == []
    data = json.loads((tmp_path / MANIFEST).read_text())
    assert data["format"] == 1 and data["wheels"][0]["toolchain"]["nvcc"] == "13.0.88"


def test_merge_keeps_other_wheels_and_replaces_the_same_one(tmp_path):
    a, b = make_entry(tmp_path, A), make_entry(tmp_path, B, b"other")
    write_manifest(tmp_path, [a])
    write_manifest(tmp_path, [b])
    assert [w.filename for w in read_manifest(tmp_path).wheels] == [A, B]
    rebuilt = make_entry(tmp_path, A, b"rebuilt wheel")
    write_manifest(tmp_path, [rebuilt])
    assert read_manifest(tmp_path).by_filename() == {A: rebuilt, B: b}
    (tmp_path / B).unlink()  # a deleted wheel's entry is stale: the next write drops it
    write_manifest(tmp_path, [rebuilt])
    assert [w.filename for w in read_manifest(tmp_path).wheels] == [A]


def test_output_is_deterministic(tmp_path):
    a, b = make_entry(tmp_path, A), make_entry(tmp_path, B, b"other")
    write_manifest(tmp_path, [b, a])
    first = (tmp_path / MANIFEST).read_bytes()
    (tmp_path / MANIFEST).unlink()
    write_manifest(tmp_path, [a, b])
    assert (tmp_path / MANIFEST).read_bytes() == first
    assert first.decode() == json.dumps(json.loads(first), indent=2, sort_keys=True) + "\n"


def test_bad_entries_are_refused_before_anything_is_written(tmp_path):
    good = make_entry(tmp_path, A)
    write_manifest(tmp_path, [good])
    before = (tmp_path / MANIFEST).read_bytes()
    with pytest.raises(BuildError, match="no such wheel"):
        write_manifest(tmp_path, [replace(good, filename=B)])
    with pytest.raises(BuildError, match="after its final repack"):
        write_manifest(tmp_path, [replace(good, sha256="0" * 64)])
    assert (tmp_path / MANIFEST).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [A, MANIFEST]  # no temp files left behind


def test_verify_catches_a_changed_byte(tmp_path):
    write_manifest(tmp_path, [make_entry(tmp_path, A, b"wheel bytes")])
    (tmp_path / A).write_bytes(b"wheel bytez")  # same size, one byte differs
    (problem,) = verify_wheels(tmp_path)
    assert problem.startswith(f"{A}: manifest.json records 11 bytes sha256") and "changed after the build" in problem
    with pytest.raises(FatalError, match="changed after the build"):
        wheelbuilder_cli(["verify", "--dir", str(tmp_path)])


def test_verify_catches_missing_and_unlisted_wheels(tmp_path):
    write_manifest(tmp_path, [make_entry(tmp_path, A)])
    (tmp_path / A).rename(tmp_path / B)
    problems = verify_wheels(tmp_path)
    assert len(problems) == 2
    assert f"{A} is listed in manifest.json but missing" in problems[0]
    assert f"{B} is in {tmp_path} but not in manifest.json" in problems[1]


def test_missing_or_malformed_manifest(tmp_path, capsys):
    (problem,) = verify_wheels(tmp_path)
    assert "does not exist" in problem and "make wheels" in problem
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(AuditError, match="not valid JSON"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps({"format": 99, "wheels": []}))
    with pytest.raises(AuditError, match="found format 99"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps({"format": 1, "wheels": [{"filename": A}]}))
    with pytest.raises(AuditError, match="missing keys"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps({"format": 1, "wheels": []}))
    assert "lists no wheels" in verify_wheels(tmp_path)[0]


def test_verify_command_reports_each_wheel(tmp_path, capsys):
    entry = make_entry(tmp_path, A)
    write_manifest(tmp_path, [entry])
    assert wheelbuilder_cli(["verify", "--dir", str(tmp_path)]) == 0
    assert f"ok  {entry.sha256}  {A}" in capsys.readouterr().out


def test_a_failed_write_leaves_the_old_manifest_whole(tmp_path, monkeypatch):
    """The disk fills up (or the process dies) during the write: readers still see the old file."""
    old = make_entry(tmp_path, A)
    write_manifest(tmp_path, [old])
    before = (tmp_path / MANIFEST).read_bytes()

    def disk_full(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("common.fsutil.os.replace", disk_full)  # the shared atomic write
    with pytest.raises(OSError, match="No space left"):
        write_manifest(tmp_path, [make_entry(tmp_path, B, b"new")])
    assert (tmp_path / MANIFEST).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [A, MANIFEST, B]


def test_a_manifest_without_system_packages_still_reads(tmp_path):
    """Manifests written before the distribution packages were recorded stay valid."""
    import json

    from wheelbuilder.manifest import WheelEntry

    d = {"filename": "x.whl", "size": 1, "sha256": "0" * 64, "recipe": "r", "recipe_version": "1",
         "source_url": "u", "source_sha256": "0" * 64, "target": "t", "arches": {"sass": [120], "ptx": []},
         "toolchain": {"nvcc": "13.0.88", "torch": "2.11.0", "python": "3.11.2", "host_compiler": "gcc"},
         "build_seconds": 1.0, "source_date_epoch": 0}
    entry = WheelEntry.from_dict(json.loads(json.dumps(d)), "manifest.json")
    assert entry.toolchain.system_packages == {}
