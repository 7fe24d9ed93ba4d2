"""The torch matrix of targets.toml: every torch minor from 2.10 to 2.15, each PyPI line for SM 12.0 and
SM 9.0, the C++ standard each torch needs, and what `wheelbuilder list` and `wheels-matrix` show of it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.version import Version

from wheelbuilder import targets as tg
from wheelbuilder.cxx_standard import check_cxx_standard, standards_in
from wheelbuilder.errors import BuildError, ConfigurationError

REPO = Path(__file__).resolve().parents[2]


def wb(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wheelbuilder", *args], cwd=REPO, capture_output=True, text=True)


def test_list_shows_every_torch_line_from_2_10_to_2_15():
    run = wb("list", "--json")
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)
    lines = sorted({".".join(r["torch"].split(".")[:2]) for r in rows}, key=Version)
    assert lines == ["2.10", "2.11", "2.12", "2.13", "2.14", "2.15"]
    assert wb("list").stdout.strip().endswith("6 torch lines: 2.10, 2.11, 2.12, 2.13, 2.14, 2.15")


def test_each_pypi_line_has_a_target_for_sm120_and_sm90_with_the_cuda_pypi_ships():
    catalog = tg.load()
    pypi = [t for t in catalog.targets.values() if t.torch.from_pypi]
    by_line: dict[str, set[str]] = {}
    for t in pypi:
        by_line.setdefault(t.torch.version, set()).update(str(a) for a in t.arches)
        assert t.toolkit.cuda.major == t.torch.cuda.major
        # nvcc of the torch's own CUDA minor for the PyPI toolkits (13.2 for torch 2.15)
        if t.toolkit.kind == "pypi":
            assert (t.toolkit.cuda.major, t.toolkit.cuda.minor) == (t.torch.cuda.major, t.torch.cuda.minor), t.name
    for version in ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0"):
        assert by_line[version] == {"12.0", "9.0"}, version
    assert catalog.target("cu132-sm120-torch2.15").toolkit.packages[0] == "nvidia-cuda-nvcc==13.2.86"


def test_torch_2_12_and_later_build_as_cxx20_older_ones_as_cxx17():
    """torch 2.12's cpp_extension already writes -std=c++20 (seen in a cu130-sm120-torch2.12 build's
    build.ninja); from 2.13 torch's headers require it; 2.10 and 2.11 write -std=c++17."""
    for t in tg.load().targets.values():
        want = "c++20" if Version(t.torch.public) >= Version("2.12") else "c++17"
        assert t.torch.cxx_standard == want, (t.name, t.torch.version)


def test_an_unknown_cxx_standard_is_refused_with_the_choices(tmp_path):
    text = (REPO / "targets.toml").read_text().replace('cxx_standard = "c++20"', 'cxx_standard = "c++2a"', 1)
    (tmp_path / "targets.toml").write_text(text)
    with pytest.raises(ConfigurationError, match=r"\[torch.cu130-2_12\]: cxx_standard 'c\+\+2a' is not one of c\+\+17, c\+\+20"):
        tg.load(tmp_path / "targets.toml")


@pytest.fixture(scope="module")
def host_torch_build(tmp_path_factory) -> Path:
    """A real (tiny, CPU-only) extension built by this venv's torch: its build.ninja holds the -std= flag
    torch.utils.cpp_extension chose. Seconds: the source includes no torch header."""
    src = tmp_path_factory.mktemp("ext")
    (src / "tiny.cpp").write_text('#include <Python.h>\nextern "C" int tiny_answer() { return 42; }\n')
    (src / "setup.py").write_text(textwrap.dedent("""
        from setuptools import setup
        from torch.utils.cpp_extension import BuildExtension, CppExtension
        setup(name="tiny", ext_modules=[CppExtension("tiny", ["tiny.cpp"])], cmdclass={"build_ext": BuildExtension})
    """))
    subprocess.run([sys.executable, "setup.py", "build_ext"], cwd=src, check=True, capture_output=True)
    return src


def test_the_standard_torch_compiled_with_is_read_from_build_ninja_and_checked(host_torch_build):
    import torch

    catalog = tg.load()
    host = next(t for t in catalog.targets.values() if t.torch.public == Version(torch.__version__).public)
    (ninja,) = host_torch_build.glob("build/*/build.ninja")
    assert standards_in(ninja)["post_cflags"] == {host.torch.cxx_standard}
    assert check_cxx_standard(host_torch_build, host.recipes[0], host) == host.torch.cxx_standard
    newer = catalog.target("cu130-sm120-torch2.14")
    with pytest.raises(BuildError, match=r"compiled with -std=c\+\+17 \(post_cflags in .*build.ninja\), but torch "
                                         r"2.14.1 needs c\+\+20 .*\[\[recipes.causal-conv1d.replace\]\]"):
        check_cxx_standard(host_torch_build, newer.recipes[0], newer)
    with pytest.raises(BuildError, match="no build/\\*/build.ninja under"):
        check_cxx_standard(host_torch_build / "no-such", newer.recipes[0], newer)
