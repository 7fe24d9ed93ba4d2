"""A new torch line for real: cu130-sm120-torch2.14 (the engines' torch) through the builder stage, audited,
imported beside its own torch in a venv of its own, and installed by pip from the PEP 503 index served
by `python -m http.server` into a fresh venv, next to today's cu130-sm120 wheel in the same index.

The wheel is built once per run (session fixture `new_line_wheels`); its reproducibility is
test_wheels_docker.py's cold-rebuild test.
"""

from __future__ import annotations

import json
import re
import subprocess
import zipfile

import pytest

from tests.wheelbuilder.test_index import fresh_venv, http_server, pip_install
from wheelbuilder.abicheck import import_check, make_torch_venv
from wheelbuilder.audit import audit_wheel
from wheelbuilder.index import write_index
from wheelbuilder.manifest import read_manifest, verify_wheels

pytestmark = [pytest.mark.docker, pytest.mark.slow]

WHEEL = "causal_conv1d-1.7.0+cu130torch2.14sm120-cp311-cp311-linux_x86_64.whl"
IMPORT = ("import torch, causal_conv1d_cuda, causal_conv1d, importlib.metadata as md; "
          "print(torch.__version__, md.version('causal-conv1d'), causal_conv1d_cuda.__file__)")


def test_new_line_wheel_is_audited_for_sm120_and_records_its_torch_and_cxx20(new_line_wheels, new_line_target):
    assert [w.name for w in sorted(new_line_wheels.glob("*.whl"))] == [WHEEL]
    assert verify_wheels(new_line_wheels) == []
    report = audit_wheel(new_line_wheels / WHEEL, new_line_target, new_line_target.recipes[0])
    assert report.arches == {"sass": [120], "ptx": []}
    (entry,) = read_manifest(new_line_wheels).wheels
    assert entry.toolchain.torch.startswith("2.14.1") and entry.toolchain.nvcc == "13.0.88"
    with zipfile.ZipFile(new_line_wheels / WHEEL) as z:
        info = json.loads(z.read("causal_conv1d-1.7.0+cu130torch2.14sm120.dist-info/wheelbuilder.json"))
    assert info["torch"] == "2.14.1" and info["cxx_standard"] == "c++20"


def test_new_line_wheel_imports_beside_its_own_torch_in_a_venv_of_its_own(new_line_wheels, new_line_target, tmp_path):
    seen = import_check(new_line_wheels / WHEEL, new_line_target, tmp_path / "abi")
    assert seen["torch"].startswith("2.14.1") and seen["torch_cuda"] == "13.0"
    assert seen["version"] == "1.7.0+cu130torch2.14sm120"


def test_pip_installs_the_new_line_wheel_from_the_served_index_and_it_imports(new_line_wheels, built_wheels,
                                                                            new_line_target, tmp_path):
    """Both lines' wheels in one index; the torch 2.14 venv asks the line's URL and gets the 2.14 wheel (the
    combined /simple would hand it the higher local label of another line)."""
    wheels = tmp_path / "wheels"
    for folder in (built_wheels, new_line_wheels):
        (wheels / folder.name).mkdir(parents=True)
        for f in [*folder.glob("*.whl"), folder / "manifest.json"]:
            (wheels / folder.name / f.name).hardlink_to(f)
    record = write_index(wheels, tmp_path / "index")
    assert sorted(w["target"] for w in record["wheels"]) == ["cu130-sm120", "cu130-sm120-torch2.14"]
    python = make_torch_venv(new_line_target, tmp_path / "venv")  # torch 2.14.1, packaging, ninja: the wheel's requirements
    with http_server(tmp_path / "index") as url:
        got = pip_install(python, "causal-conv1d", "--index-url", f"{url}/{new_line_target.name}/simple")
        # a bare venv: pip reaches for the wheel's requirements (torch, packaging, ninja), finds them nowhere in
        # the index, and says so
        bare = fresh_venv(tmp_path / "bare")
        refused = pip_install(bare, "causal-conv1d", "--index-url", f"{url}/{new_line_target.name}/simple")
    assert refused.returncode != 0, refused.stdout
    assert re.search(r"No matching distribution found for (torch|packaging|ninja)\b", refused.stderr), refused.stderr
    assert got.returncode == 0, got.stdout + got.stderr
    assert re.search(r"Successfully installed causal-conv1d-1\.7\.0\+cu130torch2\.14sm120", got.stdout), got.stdout
    out = subprocess.run([str(python), "-c", IMPORT], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    torch_version, version, so = out.stdout.split()
    assert torch_version.startswith("2.14.1") and version == "1.7.0+cu130torch2.14sm120"
    assert so.startswith(str(tmp_path / "venv"))
