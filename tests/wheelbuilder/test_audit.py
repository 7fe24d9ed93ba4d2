"""wheelbuilder.audit on synthetic wheels around extension modules compiled here by nvcc and linked
against the installed torch's libraries (marker `nvcc`): one passing wheel, then one wheel per way
a build goes wrong, each of which must be named in the AuditError."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from wheelbuilder.audit import audit_so, audit_wheel, find_modules
from wheelbuilder.errors import AuditError
from wheelbuilder.targets import load
from wheelbuilder.variants import with_arches, with_python
from wheelbuilder.wheelfile import BUILD_INFO, build_info, repack_deterministic

KERNEL = r"""
__global__ void add(float* x, float y) { x[threadIdx.x] += y; }
extern "C" void launch(float* x) { add<<<1, 32>>>(x, 1.0f); }
"""
GENCODE = {
    "sm120": ["-gencode", "arch=compute_120,code=sm_120"],
    "sm90ptx": ["-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_90,code=compute_90"],
    "sm90_sm120": ["-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_120,code=sm_120"],
}
MODULE = "causal_conv1d_cuda.cpython-311-x86_64-linux-gnu.so"
EPOCH = 1_700_000_000


def find_nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return shutil.which("nvcc") or next((p for p in [f"{cuda_home}/bin/nvcc"] if Path(p).is_file()), None)


@pytest.fixture(scope="session")
def torch_modules(tmp_path_factory) -> dict[str, Path]:
    """The kernel compiled per GENCODE into a .so that links torch's libraries and the shared CUDA
    runtime, as torch.utils.cpp_extension does (--no-as-needed: the tiny kernel uses none of them)."""
    nvcc = find_nvcc()
    spec = importlib.util.find_spec("torch")
    if nvcc is None or spec is None:
        pytest.skip("needs nvcc and an installed torch")
    torch_lib = Path(spec.origin).parent / "lib"
    out = tmp_path_factory.mktemp("modules")
    (out / "k.cu").write_text(KERNEL)
    built = {}
    for name, gencode in GENCODE.items():
        subprocess.run([nvcc, "k.cu", "-shared", "-Xcompiler", "-fPIC", "-cudart", "shared", *gencode,
                        "-Xlinker", "--no-as-needed", f"-L{torch_lib}", "-lc10", "-lc10_cuda", "-ltorch",
                        "-ltorch_cpu", "-o", f"{name}.so"], check=True, cwd=out)
        built[name] = out / f"{name}.so"
    return built


@pytest.fixture(scope="module")
def catalog():
    return load()


@pytest.fixture
def target(catalog):
    return catalog.target("cu130-sm120")


def make_wheel(dest: Path, target, recipe, so: Path | None, *, tag: str = "cp311-cp311-linux_x86_64",
               local: str | None = None, torch: str | None = None) -> Path:
    """A causal-conv1d wheel as the build would leave it: module + package + dist-info, repacked with
    wheelbuilder.json. The keyword arguments plant one mistake each."""
    version = f"{recipe.version}+{local or target.local_version()}"
    raw = dest / "raw" / f"causal_conv1d-{version}-{tag}.whl"
    raw.parent.mkdir(parents=True, exist_ok=True)
    dist_info = f"causal_conv1d-{version}.dist-info"
    with zipfile.ZipFile(raw, "w") as zf:
        zf.writestr("causal_conv1d/__init__.py", "from causal_conv1d_cuda import *\n")
        if so is not None:
            zf.write(so, MODULE)
        zf.writestr(f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: causal_conv1d\nVersion: {version}\n")
        zf.writestr(f"{dist_info}/WHEEL", f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: {tag}\n")
    info = build_info(target, recipe)
    if torch:
        info = info.replace(f'"torch": "{target.torch.version}"'.encode(), f'"torch": "{torch}"'.encode())
    return repack_deterministic(raw, dest, extra_files={BUILD_INFO: info}, source_date_epoch=EPOCH)


def failed(report) -> set[tuple[str, str]]:
    return {(c.name, c.subject) for c in report.failures}


@pytest.mark.nvcc
def test_a_correct_wheel_passes(torch_modules, target, tmp_path):
    recipe = target.recipes[0]
    wheel = make_wheel(tmp_path, target, recipe, torch_modules["sm120"])
    report = audit_wheel(wheel, target, recipe)
    assert report.ok and report.arches == {"sass": [120], "ptx": []}
    names = {c.name for c in report.checks}
    assert names == {"module", "arches", "needed", "tags", "version", "build", "record"}
    d = report.to_dict()
    assert d["ok"] and d["modules"][MODULE]["arches"]["sass"] == [120]
    assert "libcudart.so.13" in d["modules"][MODULE]["needed"]


@pytest.mark.nvcc
def test_wrong_arch_fails(torch_modules, target, tmp_path):
    wheel = make_wheel(tmp_path, target, target.recipes[0], torch_modules["sm90ptx"])
    with pytest.raises(AuditError) as e:
        audit_wheel(wheel, target, target.recipes[0])
    msg = str(e.value)
    assert "failed 2 of" in msg
    assert f"[arches] {MODULE} SASS: seen sm_90; expected sm_120" in msg
    assert f"[arches] {MODULE} PTX: seen compute_90; expected none" in msg


@pytest.mark.nvcc
def test_extra_arch_fails(torch_modules, target, tmp_path):
    wheel = make_wheel(tmp_path, target, target.recipes[0], torch_modules["sm90_sm120"])
    report = audit_wheel(wheel, target, target.recipes[0], raise_on_failure=False)
    assert failed(report) == {("arches", f"{MODULE} SASS")}
    assert report.failures[0].seen == "sm_90, sm_120" and "arch_patch" in report.failures[0].fix


@pytest.mark.nvcc
def test_ptx_arch_passes_only_with_ptx_in_the_target(torch_modules, target, tmp_path):
    sm90ptx = with_arches(target, "9.0+PTX")
    wheel = make_wheel(tmp_path, sm90ptx, target.recipes[0], torch_modules["sm90ptx"])
    assert audit_wheel(wheel, sm90ptx, target.recipes[0]).arches == {"sass": [90], "ptx": [90]}
    audit_so(torch_modules["sm90ptx"], ["9.0+PTX"], cuda_major=13)
    with pytest.raises(AuditError, match=r"PTX: seen compute_90; expected none"):
        audit_so(torch_modules["sm90ptx"], ["9.0"])


@pytest.mark.nvcc
def test_wrong_tag_fails(torch_modules, target, tmp_path):
    wheel = make_wheel(tmp_path, target, target.recipes[0], torch_modules["sm120"], tag="cp312-cp312-linux_x86_64")
    report = audit_wheel(wheel, target, target.recipes[0], raise_on_failure=False)
    assert ("tags", wheel.name) in failed(report)
    tag_check = next(c for c in report.failures if c.subject == wheel.name)
    assert tag_check.seen == "cp312-cp312-linux_x86_64" and tag_check.expected == "cp311-cp311-linux_x86_64"


@pytest.mark.nvcc
def test_wrong_local_version_fails(torch_modules, target, tmp_path):
    wheel = make_wheel(tmp_path, target, target.recipes[0], torch_modules["sm120"], local="cu130torch2.10sm120")
    report = audit_wheel(wheel, target, target.recipes[0], raise_on_failure=False)
    assert failed(report) == {("version", f"{wheel.name} version")}
    assert report.failures[0].expected == "1.7.0+cu130torch2.11sm120"


@pytest.mark.nvcc
def test_missing_module_fails(target, tmp_path):
    wheel = make_wheel(tmp_path, target, target.recipes[0], None)
    with pytest.raises(AuditError, match=r"\[module\] causal_conv1d_cuda: seen not in the wheel"):
        audit_wheel(wheel, target, target.recipes[0])


@pytest.mark.nvcc
def test_wrong_torch_in_build_info_fails(torch_modules, target, tmp_path):
    wheel = make_wheel(tmp_path, target, target.recipes[0], torch_modules["sm120"], torch="2.10.0")
    with pytest.raises(AuditError, match=r"\[build\] wheelbuilder.json torch: seen 2.10.0; expected 2.11.0"):
        audit_wheel(wheel, target, target.recipes[0])


@pytest.mark.nvcc
def test_every_failure_is_listed_at_once(torch_modules, catalog, tmp_path):
    """A CUDA 13 module audited for the CUDA 12.8 target built for Python 3.12: cudart major, tags, ABI,
    local version and torch all differ, and all of them are in one error."""
    cu128 = with_python(catalog.target("cu128-sm120"), "3.12")
    cu130 = catalog.target("cu130-sm120")
    wheel = make_wheel(tmp_path, cu130, cu130.recipes[0], torch_modules["sm120"])
    report = audit_wheel(wheel, cu128, cu128.recipes[0], raise_on_failure=False)
    assert failed(report) == {
        ("tags", wheel.name), ("tags", "causal_conv1d-1.7.0+cu130torch2.11sm120.dist-info/WHEEL"),
        ("version", f"{wheel.name} version"), ("module", f"{MODULE} Python ABI"),
        ("needed", f"{MODULE} CUDA runtime"), ("build", "wheelbuilder.json torch"),
    }
    cudart = next(c for c in report.failures if c.name == "needed")
    assert (cudart.seen, cudart.expected) == ("libcudart.so.13", "libcudart.so.12")
    with pytest.raises(AuditError) as e:
        report.raise_if_failed()
    assert str(e.value).count("\n  - ") == 6 and "Fix:" in str(e.value)


@pytest.mark.nvcc
def test_bare_so_without_torch_fails_needed(tmp_path, torch_modules):
    """audit_so on a module that does not link torch (a plain nvcc .so)."""
    plain = tmp_path / "plain.so"
    subprocess.run([find_nvcc(), str(torch_modules["sm120"].parent / "k.cu"), "-shared", "-Xcompiler", "-fPIC",
                    "-gencode", "arch=compute_120,code=sm_120", "-o", str(plain)], check=True)
    assert audit_so(plain, ["12.0"]).ok  # arches only
    report = audit_so(plain, ["12.0"], cuda_major=13, raise_on_failure=False)
    assert failed(report) == {("needed", "plain.so torch libraries"), ("needed", "plain.so CUDA runtime")}
    assert report.failures[1].seen == "no libcudart"  # static cudart: nvcc's default


def test_find_modules_matches_whole_module_names():
    names = ["causal_conv1d_cuda.cpython-311-x86_64-linux-gnu.so", "causal_conv1d_cuda_extra.so",
             "pkg/sub/mod.abi3.so", "pkg/sub/mod/other.so", "causal_conv1d/__init__.py"]
    assert find_modules(names, "causal_conv1d_cuda") == [names[0]]
    assert find_modules(names, "pkg.sub.mod") == ["pkg/sub/mod.abi3.so"]


def test_not_a_wheel_is_a_clear_error(target, tmp_path):
    with pytest.raises(AuditError, match="does not exist"):
        audit_wheel(tmp_path / "x-1.0-py3-none-any.whl", target, target.recipes[0])
    bad = tmp_path / "causal_conv1d-1.7.0-cp311-cp311-linux_x86_64.whl"
    bad.write_bytes(b"not a zip")
    with pytest.raises(AuditError, match="not a zip archive"):
        audit_wheel(bad, target, target.recipes[0])
