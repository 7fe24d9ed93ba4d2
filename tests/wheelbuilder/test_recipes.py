"""Fetching, unpacking and patching the real causal-conv1d 1.7.0 sdist (downloaded once from PyPI,
sha256-checked, cached)."""

from __future__ import annotations

import ast
import hashlib
import os
import tarfile

import pytest

from wheelbuilder import recipes as rcp
from wheelbuilder import targets as tg
from wheelbuilder.errors import SourceError


@pytest.fixture(scope="module")
def recipe():
    return tg.load().target("cu130-sm120").recipes[0]


@pytest.fixture(scope="module")
def sdist(recipe):
    return rcp.fetch_sdist(recipe)


def _cc_flags_after_patch(setup_py: str, nvcc_version: str) -> list[str]:
    """Execute the arch-flag part of the (patched) setup.py as upstream would at build time and return
    the resulting cc_flag list."""
    import textwrap

    from packaging.version import Version

    ast.parse(setup_py)  # the patched file still parses
    start = setup_py.index('        cc_flag.append("-gencode")')
    hack = setup_py.index("    # HACK: The compiler flag")
    marker = setup_py.find("    " + rcp.PATCH_MARKER)
    upstream_end = marker if marker != -1 else hack
    code = "cc_flag = []\nif True:\n" + setup_py[start:upstream_end]
    if marker != -1:
        code += textwrap.dedent(setup_py[marker:hack])
    ns = {"Version": Version, "bare_metal_version": Version(nvcc_version)}
    exec(compile(code, "setup.py-block", "exec"), ns)
    return ns["cc_flag"]


def test_fetch_verifies_sha256(sdist, recipe):
    assert hashlib.sha256(sdist.read_bytes()).hexdigest() == recipe.sha256


def test_fetch_refuses_a_tampered_file(tmp_path, recipe, sdist):
    cache = tmp_path / "cache"
    bad = cache / recipe.sha256 / recipe.sdist
    bad.parent.mkdir(parents=True)
    bad.write_bytes(sdist.read_bytes() + b"tampered")
    with pytest.raises(SourceError, match="does not match the pin"):
        rcp.fetch_sdist(recipe, cache=cache)
    assert not bad.exists(), "the bad file must not stay where the good one belongs"
    assert bad.with_name(bad.name + ".bad").exists()


def test_patch_compiles_exactly_the_target_arches(tmp_path, recipe, sdist):
    src = rcp.unpack(sdist, tmp_path / "build")
    done = rcp.apply_patches(src, recipe, (tg.Arch.parse("12.0"),))
    assert len(done) == 2
    text = (src / "setup.py").read_text()
    assert rcp.PATCH_MARKER in text
    assert _cc_flags_after_patch(text, "13.0.88") == ["-gencode", "arch=compute_120,code=sm_120"]
    assert 'os.environ.get("NVCC_THREADS", "4")' in text


def test_patch_with_two_arches_and_ptx(tmp_path, recipe, sdist):
    src = rcp.unpack(sdist, tmp_path / "build")
    rcp.apply_patches(src, recipe, (tg.Arch.parse("9.0"), tg.Arch.parse("12.0+PTX")))
    flags = _cc_flags_after_patch((src / "setup.py").read_text(), "12.8")
    assert flags == ["-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_120,code=sm_120",
                     "-gencode", "arch=compute_120,code=compute_120"]


def test_unpatched_upstream_would_build_many_arches(tmp_path, sdist):
    """The reason for the patch: upstream's own list at CUDA 13."""
    src = rcp.unpack(sdist, tmp_path / "build")
    flags = _cc_flags_after_patch((src / "setup.py").read_text(), "13.0")
    assert flags.count("-gencode") == 9


def test_patch_that_no_longer_applies_stops_the_build(tmp_path, recipe, sdist):
    src = rcp.unpack(sdist, tmp_path / "build")
    setup = src / "setup.py"
    setup.write_text(setup.read_text().replace("# HACK: The compiler flag", "# moved"))
    with pytest.raises(SourceError, match="anchor .* occurs 0 times"):
        rcp.apply_patches(src, recipe, (tg.Arch.parse("12.0"),))
    src = rcp.unpack(sdist, tmp_path / "build")
    setup.write_text(setup.read_text().replace('["--threads", "4"]', '["--threads", "8"]'))
    with pytest.raises(SourceError, match="expected 1 occurrence"):
        rcp.apply_patches(src, recipe, (tg.Arch.parse("12.0"),))


def test_unpack_empties_the_fixed_build_dir(tmp_path, sdist):
    build = tmp_path / "build"
    build.mkdir()
    (build / "stale").write_text("old")
    src = rcp.unpack(sdist, build)
    assert not (build / "stale").exists() and (src / "setup.py").exists()


def test_unpack_refuses_path_traversal(tmp_path):
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        info = tarfile.TarInfo("../outside.txt")
        info.size = 0
        tar.addfile(info)
    with pytest.raises(SourceError, match=r"'\.\./outside\.txt' is not a plain file or directory inside"):
        rcp.unpack(evil, tmp_path / "build")
    assert not (tmp_path / "outside.txt").exists()


def test_recipe_env_fills_the_local_version(recipe):
    before = dict(os.environ)
    env = rcp.recipe_env(recipe, tg.load().target("cu130-sm90"))
    assert env == {"CAUSAL_CONV1D_FORCE_BUILD": "TRUE", "CAUSAL_CONV1D_LOCAL_VERSION": "cu130torch2.11sm90"}
    assert dict(os.environ) == before  # the build environment is returned, never set in this process
