"""Reproducibility of nvcc's output on one small translation unit (marker `nvcc`, seconds).

The wheel's objects are compiled with wheelbuilder.build.nvcc_fixed_flags (through NVCC_APPEND_FLAGS,
as the build passes them). Here one .cu with the kind of names that moved between two builder-stage
builds (issue: `_INTERNAL_<hash>_<len>_<file>_<hash>_<N>`) is compiled twice in the same fixed
directory under conditions made different on purpose: another working directory, another
`--threads`, a large environment, another TMPDIR, PWD/OLDPWD, a busy process beside it and another
process id. The objects must be identical; on a mismatch the assertion message is wheelbuilder.elfdiff's
report (differing sections, first differing symbols).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from wheelbuilder import targets as tg
from wheelbuilder.build import nvcc_fixed_flags
from wheelbuilder.elfdiff import explain

# Only templates are defined (like causal-conv1d's .cu files): no non-template external function or
# variable, which is when nvcc's front end appends its process id to the module id. The anonymous
# namespace and the static __device__ variable get names built from that module id.
KERNEL = r"""
static __device__ int hits[4];
namespace {
template <int N, typename T>
__global__ void scale_kernel(T* x, T a) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < N) { x[i] = x[i] * a; atomicAdd(&hits[i % 4], 1); }
}
}
template <typename T> void launch(T* x) { scale_kernel<128, T><<<1, 128>>>(x, T(2)); }
template void launch<float>(float*);
"""
# Two arches so that --threads has work to split, as with a multi-arch target.
ARCH_FLAGS = ["-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_120,code=sm_120"]
SOURCE_MTIME = 1735689600  # the source's mtime reaches the cubin's line table (test below), so it is fixed


def find_nvcc() -> str:
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    nvcc = shutil.which("nvcc") or next((p for p in [f"{cuda_home}/bin/nvcc"] if Path(p).is_file()), None)
    if nvcc is None:
        pytest.skip("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    return nvcc


@pytest.fixture()
def tu(tmp_path: Path) -> Path:
    """The source in a directory shared by both compiles of a test (paths reach the objects)."""
    src = tmp_path / "build" / "scale.cu"
    src.parent.mkdir()
    src.write_text(KERNEL)
    os.utime(src, (SOURCE_MTIME, SOURCE_MTIME))
    return src


def recipe_flags() -> list[str]:
    recipe = tg.load().target("cu130-sm120").recipes[0]
    return nvcc_fixed_flags(recipe)


def compile_tu(src: Path, keep: Path, *, threads: int, append: list[str], cwd: Path, env_extra: dict[str, str],
               busy: bool = False) -> Path:
    """nvcc -c src as torch's ninja rule does (-O3 -lineinfo --threads N); the object is copied to `keep`."""
    obj = src.with_suffix(".o")
    obj.unlink(missing_ok=True)
    env = dict(os.environ, NVCC_APPEND_FLAGS=" ".join(append), **env_extra)
    cmd = [find_nvcc(), "-c", str(src), "-o", str(obj), "-O3", "-lineinfo", "--use_fast_math", *ARCH_FLAGS,
           "--threads", str(threads), "--compiler-options", "-fPIC"]
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        subprocess.run(cmd, check=True, cwd=cwd, env=env, capture_output=True)
    finally:
        if spinner:
            spinner.kill()
            spinner.wait()
    keep.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(obj, keep)
    return keep


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def two_different_compiles(tu: Path, tmp_path: Path, append: list[str]) -> tuple[Path, Path]:
    (tmp_path / "cwd-a").mkdir()
    (tmp_path / "cwd-b" / "deeper").mkdir(parents=True)
    (tmp_path / "tmp-b").mkdir()
    a = compile_tu(tu, tmp_path / "out" / "a.o", threads=1, append=append, cwd=tmp_path / "cwd-a", env_extra={})
    b = compile_tu(tu, tmp_path / "out" / "b.o", threads=4, append=append, cwd=tmp_path / "cwd-b" / "deeper",
                   env_extra={"ENV_NOISE": "x" * 100_000, "TMPDIR": str(tmp_path / "tmp-b"),
                              "PWD": str(tmp_path / "cwd-b" / "deeper"), "OLDPWD": "/nonexistent/" + "y" * 300},
                   busy=True)
    return a, b


@pytest.mark.nvcc
def test_the_build_flags_make_one_tu_identical_under_different_conditions(tu: Path, tmp_path: Path):
    a, b = two_different_compiles(tu, tmp_path, recipe_flags())
    assert sha256(a) == sha256(b), "\n".join(explain(a, b))


@pytest.mark.nvcc
def test_without_the_seed_the_front_end_process_id_reaches_the_names(tu: Path, tmp_path: Path):
    # The control: -objtemp alone leaves cudafe++'s process id in the module id, so two compiles
    # differ in the anonymous-namespace and _INTERNAL_ names, and the report names those symbols.
    a, b = two_different_compiles(tu, tmp_path, ["-objtemp"])
    report = explain(a, b)
    assert report, "expected two compiles without -frandom-seed to differ"
    text = "\n".join(report)
    assert ".nv_fatbin" in text and ".strtab" in text
    assert "symbols only in A" in text and "_GLOBAL__N__" in text


@pytest.mark.nvcc
def test_the_source_mtime_reaches_the_cubin_line_table(tu: Path, tmp_path: Path):
    # ptxas writes each source file's mtime and size into the cubin's line table (-lineinfo), so the
    # build keeps the sdist's archive mtimes (tarfile does) and the header trees' mtimes matter too.
    flags = recipe_flags()
    a = compile_tu(tu, tmp_path / "out" / "a.o", threads=1, append=flags, cwd=tmp_path, env_extra={})
    os.utime(tu, (SOURCE_MTIME + 1, SOURCE_MTIME + 1))
    b = compile_tu(tu, tmp_path / "out" / "b.o", threads=1, append=flags, cwd=tmp_path, env_extra={})
    report = explain(a, b)
    assert any(line.strip().startswith("sections differing: .nv_fatbin") for line in report), report
    assert not any("symbols" in line for line in report), report


def test_clamp_mtimes_sets_only_newer_regular_files(tmp_path: Path):
    from wheelbuilder.toolkit import clamp_mtimes

    root = tmp_path / "include"
    (root / "cub" / "block").mkdir(parents=True)
    new, old = root / "cub" / "block" / "block_load.cuh", root / "old.h"
    new.write_text("// new")
    old.write_text("// old")
    os.utime(old, (SOURCE_MTIME - 100, SOURCE_MTIME - 100))
    (root / "link.h").symlink_to(new)
    assert clamp_mtimes([root], SOURCE_MTIME) == 1
    assert new.stat().st_mtime == SOURCE_MTIME and old.stat().st_mtime == SOURCE_MTIME - 100
    assert clamp_mtimes([root], SOURCE_MTIME) == 0


@pytest.mark.nvcc
def test_a_header_installed_at_another_time_gives_the_same_object_once_clamped(tmp_path: Path):
    # A header's mtime reaches the cubin like the source's: pip writes torch's and CUDA's headers at
    # install time, so two builder layers built at different times differ unless prepare-toolkit clamps them.
    from wheelbuilder.toolkit import clamp_mtimes

    inc = tmp_path / "include"
    inc.mkdir()
    header = inc / "twice.cuh"
    header.write_text("__device__ __forceinline__ float twice(float v) { return v * 2.0f + 1.0f; }\n")
    src = tmp_path / "build" / "k.cu"
    src.parent.mkdir()
    src.write_text('#include "twice.cuh"\n__global__ void k(float* x) { x[threadIdx.x] = twice(x[threadIdx.x]); }\n')
    os.utime(src, (SOURCE_MTIME, SOURCE_MTIME))
    flags = recipe_flags()
    objects = []
    for installed_at in (SOURCE_MTIME + 1000, SOURCE_MTIME + 5000):
        os.utime(header, (installed_at, installed_at))
        raw = compile_tu(src, tmp_path / "out" / f"raw-{installed_at}.o", threads=1, append=flags + [f"-I{inc}"],
                         cwd=tmp_path, env_extra={})
        clamp_mtimes([inc], SOURCE_MTIME)
        objects.append((raw, compile_tu(src, tmp_path / "out" / f"clamped-{installed_at}.o", threads=1,
                                        append=flags + [f"-I{inc}"], cwd=tmp_path, env_extra={})))
    (raw_a, clamped_a), (raw_b, clamped_b) = objects
    assert explain(raw_a, raw_b), "the header's mtime should reach .nv_fatbin"
    assert sha256(clamped_a) == sha256(clamped_b), "\n".join(explain(clamped_a, clamped_b))
