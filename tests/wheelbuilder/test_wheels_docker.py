"""The real thing: `make wheels TARGET=cu130-sm120` through the Dockerfile's builder stage.

The wheel is built once per run (session fixture `built_wheels`), audited, installed into a clean venv
with its torch and imported. Reproducibility is checked on the newest torch line CI builds
(cu130-sm120-torch2.14, fixture `new_line_wheels`): a second, cold build from another checkout directory
must give the same bytes. The cu128 default target's wheel cannot be built here (its nvcc is in a registry image): its
plan is checked as far as it goes, here and in tests/wheelbuilder/test_cu128.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from wheelbuilder import targets as tg
from wheelbuilder.audit import audit_wheel
from wheelbuilder.manifest import read_manifest, verify_wheels

REPO = Path(__file__).resolve().parents[2]
WHEEL = "causal_conv1d-1.7.0+cu130torch2.11sm120-cp311-cp311-linux_x86_64.whl"
NEW_LINE_WHEEL = "causal_conv1d-1.7.0+cu130torch2.14sm120-cp311-cp311-linux_x86_64.whl"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.docker
@pytest.mark.slow
def test_builder_stage_leaves_an_audited_wheel_and_manifest(built_wheels, ci_target):
    wheels = sorted(built_wheels.glob("*.whl"))
    assert [w.name for w in wheels] == [WHEEL]
    assert verify_wheels(built_wheels) == []
    report = audit_wheel(wheels[0], ci_target, ci_target.recipes[0])
    assert report.arches == {"sass": [120], "ptx": []}
    (entry,) = read_manifest(built_wheels).wheels
    assert entry.sha256 == sha256(wheels[0]) and entry.size == wheels[0].stat().st_size
    assert entry.source_sha256 == ci_target.recipes[0].sha256
    assert entry.toolchain.nvcc == "13.0.88" and entry.toolchain.torch.startswith("2.11.0")
    # The builder's Debian packages that feed the objects: compiler, C/C++ headers, Python's headers, binutils.
    assert {"libc6-dev", "libstdc++-12-dev", "g++-12", "libpython3.11-dev", "binutils"} <= set(entry.toolchain.system_packages)
    assert entry.arches == {"sass": [120], "ptx": []}
    assert entry.build_seconds > 0
    # nothing half-written is left beside the results
    assert not list(built_wheels.glob(".staging-*"))


@pytest.mark.docker
@pytest.mark.slow
def test_wheel_imports_in_a_clean_venv_with_its_torch(built_wheels, tmp_path):
    """A fresh venv from the runtime lock (hash-checked), the wheel with --no-deps, then the import
    that fails with `undefined symbol: _ZN3c10...` when torch and the wheel disagree."""
    py = shutil.which(f"python{tg.load().target('cu130-sm120').python}")
    if py is None:
        pytest.skip("needs the target's Python on the host")
    uv = Path(sys.executable).parent / "uv"
    assert uv.is_file(), "uv comes with the dev lock: run `make venv`"
    venv = tmp_path / "venv"
    subprocess.run([py, "-m", "venv", str(venv)], check=True)
    # uv, as `make venv` does: hard links from its cache, so a second multi-GB torch costs no disk.
    install = [str(uv), "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"), "--link-mode", "hardlink"]
    subprocess.run(install + ["--require-hashes", "-r", str(REPO / "locks/cu130/runtime.txt")], check=True)
    subprocess.run(install + ["--no-deps", str(built_wheels / WHEEL)], check=True)
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import torch, causal_conv1d_cuda, causal_conv1d, importlib.metadata as md; "
         "print(torch.__version__, md.version('causal-conv1d'), causal_conv1d_cuda.__file__)"],
        capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    torch_version, wheel_version, so = out.stdout.split()
    assert torch_version.startswith("2.11.0") and wheel_version == "1.7.0+cu130torch2.11sm120"
    assert so.startswith(str(venv))


@pytest.mark.docker
@pytest.mark.slow
def test_two_cold_builds_in_different_directories_give_the_same_wheel(new_line_wheels, new_line_target, tmp_path):
    """Another checkout directory, no layer cache for the compile (REBUILD nonce), a cold compile (the
    builder's default: no ccache), another MAX_JOBS and NVCC_THREADS than the first build's (so other
    nvcc command lines and other process ids), and another compile environment (REBUILD, a 32-character
    nonce instead of "0", is in the RUN's environment): the wheel's sha256 must not change. On a
    mismatch the message names the differing members, ELF sections and symbols (wheelbuilder.elfdiff)."""
    import re

    from wheelbuilder.elfdiff import explain

    checkout = tmp_path / "elsewhere" / "dflash-images"
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard"],
                           capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (REPO / f).is_file():
            (checkout / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, checkout / f)
    out = tmp_path / "out"
    # The planner never picks one job of two threads (one job means one worker, so one thread).
    jobs, threads = ("2", "1") if (os.environ.get("MAX_JOBS"), os.environ.get("NVCC_THREADS")) == ("1", "2") else ("1", "2")
    env = dict(os.environ, PYTHONPATH=str(checkout), MAX_JOBS=jobs, NVCC_THREADS=threads)
    env.pop("CCACHE_DISABLE", None)
    subprocess.run([sys.executable, "-c",
                    "import sys; from images.build import build_wheels; from wheelbuilder import targets;"
                    f"build_wheels(targets.load().target({new_line_target.name!r}), __import__('pathlib').Path({str(out)!r}),"
                    f" rebuild={uuid.uuid4().hex!r})"],
                   cwd=checkout, env=env, check=True)
    plan = (checkout / "logs" / f"{new_line_target.name}-causal-conv1d.log").read_text()
    assert re.search(rf"^\s+max_jobs\s+{jobs}$", plan, re.M) and re.search(rf"^\s+nvcc_threads\s+{threads}$", plan, re.M)
    assert sha256(out / NEW_LINE_WHEEL) == sha256(new_line_wheels / NEW_LINE_WHEEL), \
        "\n".join(explain(new_line_wheels / NEW_LINE_WHEEL, out / NEW_LINE_WHEEL))
    assert json.loads((out / "manifest.json").read_text())["wheels"][0]["sha256"] == sha256(new_line_wheels / NEW_LINE_WHEEL)


@pytest.mark.docker
def test_cu128_default_target_plan_resolves(capsys):
    """The default target's wheel needs a registry (its nvcc is in NVIDIA's devel image); its build
    command and args are checked here, the rest of it in tests/wheelbuilder/test_cu128.py."""
    from images.build import BuildSpec, base_args, wheels_spec

    target = tg.load().target(None)
    assert target.name == "cu128-sm120"
    spec = wheels_spec(target, Path("/tmp/out"))
    assert spec.build_args["BUILDER_BASE"] == "dflash-base:bookworm"
    assert spec.build_args["CUDA_IMAGE"].startswith("nvidia/cuda:12.8.1-devel-ubuntu24.04")
    assert spec.build_args["TORCH_LOCK"] == "cu128"
    cmd = spec.command()
    assert "--target" in cmd and "wheels" in cmd and any(a.startswith("type=local") for a in cmd)
    assert isinstance(spec, BuildSpec) and base_args(target, "builder-os")["TARGET"] == "cu128-sm120"


@pytest.mark.docker
def test_dockerfile_stages_and_args_resolve_for_the_default_target():
    """Every stage the CLI names exists, every build arg it passes is declared, and there is no
    `# syntax=` line (it would make BuildKit pull a frontend image)."""
    import re

    from images.build import base_args, wheels_spec

    text = (REPO / "Dockerfile").read_text()
    assert not re.search(r"^#\s*syntax=", text, re.M)
    stages = set(re.findall(r"^FROM \S+ AS (\S+)", text, re.M))
    assert {"toolkit", "wheel-build", "wheels", "runtime"} <= stages
    declared = set(re.findall(r"^ARG (\w+)", text, re.M))
    target = tg.load().target("cu130-sm120")
    assert set(wheels_spec(target, Path("/tmp/x")).build_args) <= declared
    assert set(base_args(target, "runtime-os")) | {"GIT_REVISION", "WHEEL_SHA256", "BUILD_CHECK"} <= declared
    # python-torch starts from one of the two OS stages, named by TORCH_ENV_FROM.
    assert {"builder-os", "runtime-os", "python-torch"} <= stages
    assert re.search(r"^FROM \$\{TORCH_ENV_FROM\} AS python-torch$", text, re.M)
    default_builder = re.search(r"^ARG BUILDER_BASE=(\S+)", text, re.M).group(1)
    assert default_builder == tg.load().target(None).toolkit.builder_base


@pytest.mark.docker
def test_too_little_disk_fails_before_the_build_naming_the_numbers(ci_target, tmp_path, monkeypatch):
    """A full disk must stop the build up front, not as `No space left on device` inside a 5 GB layer."""
    from images.build import build_wheels
    from images.errors import EngineError

    monkeypatch.setenv("DFLASH_MIN_FREE_GIB", "1000000")
    out = tmp_path / "wheels"
    with pytest.raises(EngineError, match=r"data root \S+ has [0-9.]+ GiB free; building the wheels for cu130-sm120 needs about 1000000 GiB") as e:
        build_wheels(ci_target, out)
    assert "docker builder prune" in str(e.value) and "DFLASH_MIN_FREE_GIB" in str(e.value)
    assert not out.exists() or not any(out.iterdir())
