"""Toolchain checks fail fast, before any download or compile, with the fix in the message.

The fake `nvcc` scripts below are test doubles: shell scripts that only answer `--version` the way
a CUDA 12.8 or 13.0 nvcc does, to exercise the version checks without a second toolkit installed."""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from wheelbuilder import targets as tg
from wheelbuilder import toolkit as tk
from wheelbuilder.errors import ToolchainError

GIB = 1 << 30


def fake_cuda_home(tmp_path: Path, release: str) -> Path:
    home = tmp_path / f"cuda-{release}"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release[:4]}, V{release}'\n")
    nvcc.chmod(0o755)
    return home


@pytest.fixture
def target():
    return tg.load().target("cu130-sm120")


def test_no_nvcc_says_to_use_make_wheels(tmp_path):
    with pytest.raises(ToolchainError, match="make wheels"):
        tk.find_cuda_home([tmp_path / "nothing-here"])


def test_nvcc_torch_major_mismatch_is_refused(tmp_path, target):
    home = fake_cuda_home(tmp_path, "12.8.93")
    with pytest.raises(ToolchainError, match="major versions differ"):
        tk.check_toolchain(target, [home])


def test_nvcc_too_old_for_arch(tmp_path, target, monkeypatch):
    """Every known arch compiles with CUDA 13.0, so pretend 12.1 needs 13.1 to see the refusal."""
    monkeypatch.setitem(tg.ARCH_MIN_CUDA, "12.1", "13.1")
    home = fake_cuda_home(tmp_path, "13.0.88")
    t = dataclasses.replace(target, arches=(tg.Arch(12, 1),))
    with pytest.raises(ToolchainError, match=r"nvcc 13.0.88 .* cannot compile arch 12.1 \(needs CUDA >= 13.1\)"):
        tk.check_toolchain(t, [home])


def test_python_mismatch_names_the_interpreter(target):
    other = dataclasses.replace(target, toolkit=dataclasses.replace(target.toolkit, python="3.9"))
    with pytest.raises(ToolchainError, match=r"Python 3.9.*python3.9"):
        tk.check_toolchain(other)


def test_missing_pip_is_named_before_the_build(target, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pip" else real(name, *a))
    with pytest.raises(ToolchainError, match=r"pip is not installed.*ensurepip.*--seed"):
        tk.check_toolchain(target)


def test_torch_mismatch_is_refused(target):
    pin = dataclasses.replace(target.torch, version="2.10.0")
    with pytest.raises(ToolchainError, match="only works with the torch minor it was built against"):
        tk.check_toolchain(dataclasses.replace(target, torch=pin))


@pytest.mark.nvcc
def test_real_toolchain_passes_for_the_ci_target(target):
    if f"{sys.version_info.major}.{sys.version_info.minor}" != target.python:
        pytest.skip("needs the target's Python")
    tc = tk.check_toolchain(target)
    assert tc.nvcc_version.major == 13 and tc.torch_cuda == Version("13.0")


@pytest.mark.parametrize("cores,mem_gib,expect", [
    (2, 24, (2, 1)),      # 2 cores: two files at once, one thread each
    (16, 128, (4, 4)),    # 4 source files, 4 nvcc threads each
    (16, 8, (2, 1)),      # memory-bound: 8 GiB * 0.8 / 3 GiB -> 2 workers
    (1, 1, (1, 1)),       # never below one
])
def test_plan_jobs_sizes_from_cores_and_memory(monkeypatch, cores, mem_gib, expect):
    monkeypatch.delenv("MAX_JOBS", raising=False)
    monkeypatch.delenv("NVCC_THREADS", raising=False)
    assert tk.plan_jobs(cores, mem_gib * GIB, files=4) == expect


def test_plan_jobs_respects_explicit_max_jobs(monkeypatch):
    monkeypatch.setenv("MAX_JOBS", "1")
    monkeypatch.setenv("NVCC_THREADS", "2")
    assert tk.plan_jobs(16, 128 * GIB) == (1, 2)


def test_prepare_pip_cuda_home_makes_the_two_links(tmp_path):
    home = tmp_path / "cu13"
    (home / "lib").mkdir(parents=True)
    (home / "lib" / "libcudart.so.13").write_bytes(b"")
    assert tk.prepare_pip_cuda_home(home) == ["lib64 -> lib", "lib/libcudart.so -> libcudart.so.13"]
    assert (home / "lib64" / "libcudart.so").exists()
    assert tk.prepare_pip_cuda_home(home) == []  # idempotent


@pytest.mark.skipif(not shutil.which("dpkg-query") or not shutil.which("c++"), reason="needs dpkg and a C++ compiler")
def test_system_packages_names_the_compiler_and_the_libc_headers_with_dpkgs_versions():
    pkgs = tk.system_packages()
    assert "libc6-dev" in pkgs and any(name.startswith("g++") for name in pkgs), pkgs
    for name, version in pkgs.items():
        out = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", name], capture_output=True, text=True)
        assert out.stdout == version


def test_system_packages_is_empty_without_dpkg(monkeypatch):
    monkeypatch.setattr(tk.shutil, "which", lambda name: None if name == "dpkg-query" else "/usr/bin/" + name)
    assert tk.system_packages() == {}
