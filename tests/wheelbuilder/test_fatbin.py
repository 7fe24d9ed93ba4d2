"""wheelbuilder.fatbin against device code compiled here by nvcc (marker `nvcc`), plus the pure
compatibility rules of `covers` and the byte-level parser on hand-made containers (fast, no nvcc)."""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from wheelbuilder.audit import audit_so
from wheelbuilder.errors import AuditError
from wheelbuilder.fatbin import (FATBIN_MAGIC, FatbinEntry, arch_summary, covers, main, needed_libraries,
                                 parse_fatbin_section, read_fatbin)

KERNEL = r"""
__global__ void add(float* x, float y) { x[threadIdx.x] += y; }
extern "C" void launch(float* x) { add<<<1, 32>>>(x, 1.0f); }
"""

# name -> nvcc arguments after the source file
OBJECTS = {
    "sm90_ptx.so": ["-shared", "-Xcompiler", "-fPIC", "-gencode", "arch=compute_90,code=sm_90",
                    "-gencode", "arch=compute_90,code=compute_90"],
    "sm120.so": ["-shared", "-Xcompiler", "-fPIC", "-gencode", "arch=compute_120,code=sm_120"],
    "sm120_small.so": ["-shared", "-Xcompiler", "-fPIC", "-gencode", "arch=compute_120,code=sm_120",
                       "--compress-mode=size"],
    "sm120a.so": ["-shared", "-Xcompiler", "-fPIC", "-gencode", "arch=compute_120a,code=sm_120a"],
    "sm90_sm120_rdc.so": ["-shared", "-rdc=true", "-Xcompiler", "-fPIC", "-gencode", "arch=compute_90,code=sm_90",
                          "-gencode", "arch=compute_120,code=sm_120"],
    "sm90_rdc.o": ["-c", "-rdc=true", "-Xcompiler", "-fPIC", "-gencode", "arch=compute_90,code=sm_90"],
}


def find_nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return shutil.which("nvcc") or next((p for p in [f"{cuda_home}/bin/nvcc"] if Path(p).is_file()), None)


@pytest.fixture(scope="session")
def cuda_objects(tmp_path_factory) -> dict[str, Path]:
    """Compile the tiny kernel once per session into each of OBJECTS (about 1.5 s each)."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    out = tmp_path_factory.mktemp("fatbin")
    (out / "k.cu").write_text(KERNEL)
    built = {}
    for name, args in OBJECTS.items():
        subprocess.run([nvcc, str(out / "k.cu"), *args, "-o", str(out / name)], check=True, cwd=out)
        built[name] = out / name
    return built


# --- real nvcc output ----------------------------------------------------------------------------

@pytest.mark.nvcc
def test_sass_and_ptx_for_sm90(cuda_objects):
    entries = read_fatbin(cuda_objects["sm90_ptx.so"])
    # nvcc's device-link step adds its own small cubin beside the kernel's: two SASS, one PTX
    assert [(e.kind, e.sm) for e in entries] == [("sass", 90), ("ptx", 90), ("sass", 90)]
    ptx = entries[1]
    assert ptx.compressed and ptx.name == "compute_90"  # CUDA 13 compresses PTX by default
    assert all(not e.compressed and e.size > 1000 for e in entries if e.kind == "sass")
    assert arch_summary(cuda_objects["sm90_ptx.so"]) == {"sass": [90], "ptx": [90], "arch_specific": []}


@pytest.mark.nvcc
def test_sass_only_for_sm120(cuda_objects):
    entries = read_fatbin(cuda_objects["sm120.so"])
    assert {(e.kind, e.sm, e.compressed) for e in entries} == {("sass", 120, False)}
    assert arch_summary(cuda_objects["sm120.so"]) == {"sass": [120], "ptx": [], "arch_specific": []}


@pytest.mark.nvcc
def test_compressed_entries_detected_with_uncompressed_size(cuda_objects):
    plain = read_fatbin(cuda_objects["sm120.so"])
    small = read_fatbin(cuda_objects["sm120_small.so"])
    assert all(e.compressed for e in small)
    # the header's uncompressed size equals the size of the same cubin stored plain
    assert [e.size for e in small] == [e.size for e in plain]
    assert cuda_objects["sm120_small.so"].stat().st_size < cuda_objects["sm120.so"].stat().st_size


@pytest.mark.nvcc
def test_arch_specific_sass_runs_only_on_its_own_sm(cuda_objects):
    summary = arch_summary(cuda_objects["sm120a.so"])
    assert summary == {"sass": [120], "ptx": [], "arch_specific": [120]}
    assert covers(summary, 120)[0]
    ok, reason = covers(summary, 121)
    assert not ok and "sm_120a" in reason


@pytest.mark.nvcc
def test_relocatable_copy_is_ignored_when_loadable_code_exists(cuda_objects):
    entries = read_fatbin(cuda_objects["sm90_sm120_rdc.so"])
    sections = {e.section for e in entries}
    assert sections == {".nv_fatbin", "__nv_relfatbin"}
    assert arch_summary(cuda_objects["sm90_sm120_rdc.so"])["sass"] == [90, 120]
    # an -rdc object has only relocatable code: that is what it covers
    assert arch_summary(cuda_objects["sm90_rdc.o"])["sass"] == [90]


@pytest.mark.nvcc
def test_reads_an_open_stream_and_dt_needed(cuda_objects):
    with open(cuda_objects["sm120.so"], "rb") as f:
        assert read_fatbin(f) == read_fatbin(cuda_objects["sm120.so"])
    assert "libc.so.6" in needed_libraries(cuda_objects["sm120.so"])
    assert needed_libraries(cuda_objects["sm90_rdc.o"]) == []  # relocatable objects have no .dynamic


@pytest.mark.nvcc
def test_cli_json_and_coverage_exit_code(cuda_objects, capsys):
    assert main([str(cuda_objects["sm120.so"]), "--sm", "120"]) == 0
    assert main([str(cuda_objects["sm120.so"]), "--sm", "90"]) == 1
    assert "NOT COVERED" in capsys.readouterr().out


@pytest.mark.nvcc
def test_audit_so_wants_exactly_the_asked_arches(cuda_objects):
    assert audit_so(cuda_objects["sm120.so"], ["12.0"]).ok
    assert audit_so(cuda_objects["sm90_ptx.so"], ["9.0+PTX"]).modules["sm90_ptx.so"]["arches"] == {"sass": [90],
                                                                                                 "ptx": [90]}
    with pytest.raises(AuditError, match=r"SASS: seen sm_120; expected sm_90"):
        audit_so(cuda_objects["sm120.so"], ["9.0"])
    with pytest.raises(AuditError, match=r"SASS: seen sm_90, sm_120; expected sm_120"):
        audit_so(cuda_objects["sm90_sm120_rdc.so"], ["12.0"])
    with pytest.raises(AuditError, match=r"SASS: seen sm_120a; expected sm_120"):
        audit_so(cuda_objects["sm120a.so"], ["12.0"])


def test_not_an_elf_file_is_a_clear_error(tmp_path):
    f = tmp_path / "k.cu"
    f.write_text(KERNEL)
    with pytest.raises(AuditError, match="not an ELF file"):
        read_fatbin(f)
    with pytest.raises(AuditError, match="does not exist"):
        read_fatbin(tmp_path / "missing.so")


# --- the byte-level parser on hand-made containers ------------------------------------------------

def entry(kind: int, sm: int, payload: bytes, flags: int = 0x11, uncompressed: int = 0) -> bytes:
    """A 64-byte entry header + payload padded to 8 bytes, laid out as nvcc 13 writes it."""
    padded = payload + b"\0" * (-len(payload) % 8)
    head = struct.pack("<HHIQIIHHI", kind, 0x101, 64, len(padded), len(payload) if uncompressed else 0, 0, 8, 1, sm)
    head += b"\0" * 8 + struct.pack("<Q", flags) + b"\0" * 8 + struct.pack("<Q", uncompressed)
    return head + padded


def container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body


def test_several_containers_with_padding_between_them():
    data = container(entry(2, 90, b"\x7fELF" + b"x" * 100)) + b"\0" * 8 + container(
        entry(1, 120, b"z" * 30, flags=0x8011, uncompressed=500), entry(2, 120, b"\x7fELF" * 10))
    got = parse_fatbin_section(data)
    assert got == [FatbinEntry("sass", 90, 104, False), FatbinEntry("ptx", 120, 500, True),
                   FatbinEntry("sass", 120, 40, False)]
    assert covers({"sass": [90], "ptx": [120]}, 120)[0]


def test_lz4_flag_of_older_cuda_counts_as_compressed():
    (e,) = parse_fatbin_section(container(entry(2, 80, b"q" * 16, flags=0x2011, uncompressed=64)))
    assert e.compressed and e.size == 64


def test_damaged_fatbins_fail_loudly():
    good = container(entry(2, 90, b"x" * 16))
    with pytest.raises(AuditError, match="damaged fatbin"):
        parse_fatbin_section(good[:-8], where="lib.so")  # payload runs past the section
    with pytest.raises(AuditError, match="unrecognised bytes"):
        parse_fatbin_section(good + b"garbage!" + b"\0" * 8)
    bad_entry = bytearray(good)
    struct.pack_into("<I", bad_entry, 16 + 4, 8)  # entry header size below 64
    with pytest.raises(AuditError, match="past its container"):
        parse_fatbin_section(bytes(bad_entry))


# --- compatibility rules -------------------------------------------------------------------------

@pytest.mark.parametrize("summary, sm, ok, says", [
    ({"sass": [120], "ptx": []}, 120, True, "natively"),
    ({"sass": [120], "ptx": []}, 121, True, "equal or higher minor"),   # 12.0 SASS runs on 12.1
    ({"sass": [121], "ptx": []}, 120, False, "nothing runs"),           # but not downward
    ({"sass": [90], "ptx": []}, 120, False, "Rebuild for arch 12.0"),  # never across majors
    ({"sass": [100], "ptx": []}, 120, False, "sm_100"),
    ({"sass": [80], "ptx": [80]}, 90, True, "PTX compute_80 JIT"),     # PTX JITs upward
    ({"sass": [], "ptx": [120]}, 90, False, "compute_120"),            # but never downward
    ({"sass": [], "ptx": []}, 90, False, "no device code at all"),
    ({"sass": [90], "ptx": [], "arch_specific": [90]}, 90, True, "natively"),
])
def test_covers_follows_cuda_compatibility_rules(summary, sm, ok, says):
    got, reason = covers(summary, sm)
    assert got is ok and says in reason


# --- a vendor library as shipped (no nvcc needed) ------------------------------------------------

def test_reads_the_installed_curand_like_cuobjdump():
    """libcurand from torch's CUDA wheels: many containers, compressed PTX, SASS for every arch.
    cuobjdump 13.2 lists the same entries (11 cubins per arch, 10 PTX for sm_121) for 10.4.0.35."""
    spec = importlib.util.find_spec("nvidia")
    libs = sorted(Path(p) for d in (spec.submodule_search_locations if spec else []) for p in
                  glob.glob(f"{d}/cu13/lib/libcurand.so.*"))
    if not libs:
        pytest.skip("torch's nvidia-curand wheel is not installed")
    entries = read_fatbin(libs[0])
    summary = arch_summary(libs[0])
    assert {90, 120}.issubset(summary["sass"]) and covers(summary, 120)[0]
    per_arch = {sm: sum(e.sm == sm for e in entries if e.kind == "sass") for sm in summary["sass"]}
    assert len(set(per_arch.values())) == 1  # every kernel module is built for every arch
    assert all(e.compressed for e in entries if e.kind == "ptx")
