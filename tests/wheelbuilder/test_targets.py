"""targets.toml loading and validation: every mistake fails with a message naming the fix."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.version import Version

from wheelbuilder import targets as tg
from wheelbuilder import variants
from wheelbuilder.errors import ConfigurationError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "targets.toml"
    p.write_text(text)
    return p


def real_text() -> str:
    return (REPO / "targets.toml").read_text()


def test_real_file_loads_with_its_targets_and_default():
    cat = tg.load()
    assert set(cat.targets) == {"cu128-sm120", "cu128-sm120-torch2.11", "cu130-sm120", "cu130-sm90",
                                "cu128-sm120-torch2.14"} | {f"{cuda}-sm{sm}-torch{line}" for sm in (120, 90) for cuda, line in
                                                            (("cu130", "2.12"), ("cu130", "2.13"), ("cu130", "2.14"),
                                                             ("cu132", "2.15"))}
    assert cat.default_target == "cu128-sm120"
    t = cat.target(None)
    # The default locks from PyPI alone (PyPI's torch 2.10.0 is a CUDA 12.8 build); nvcc 12.8 comes
    # out of NVIDIA's devel image into the same offline Debian base the runtime uses.
    assert t.name == "cu128-sm120" and t.torch.version == "2.10.0" and t.torch.from_pypi and t.python == "3.11"
    assert [a.sm for a in t.arches] == [120]
    assert t.toolkit.kind == "image" and t.toolkit.image == "nvidia/cuda:12.8.1-devel-ubuntu24.04"
    assert t.toolkit.image_cuda_home == "/usr/local/cuda-12.8"
    assert t.toolkit.builder_base == t.toolkit.runtime_base == "dflash-base:bookworm"
    variant = cat.target("cu128-sm120-torch2.11")
    assert variant.torch.version == "2.11.0+cu128" and not variant.torch.from_pypi
    assert variant.toolkit == t.toolkit and variant.torch.lock != t.torch.lock


def test_local_version_names_cuda_torch_and_arch():
    cat = tg.load()
    assert cat.target("cu128-sm120").local_version() == "cu128torch2.10sm120"
    assert cat.target("cu128-sm120-torch2.11").local_version() == "cu128torch2.11sm120"
    assert cat.target("cu130-sm120").local_version() == "cu130torch2.11sm120"
    assert cat.target("cu130-sm90").local_version() == "cu130torch2.11sm90"


def test_pypi_toolkit_pins_match_the_builder_lock():
    """The toolkit wheels named in targets.toml are exactly what locks/cu130/builder.txt installs."""
    cat = tg.load()
    lock = (REPO / "locks/cu130/builder.txt").read_text()
    for pkg in cat.target("cu130-sm120").toolkit.packages:
        name, version = pkg.split("==")
        assert re.search(rf"^{re.escape(name)}=={re.escape(version)} \\$", lock, re.M), pkg
    assert re.search(r"^torch==2\.11\.0 \\$", lock, re.M)
    assert "--hash=sha256:" in lock


@pytest.mark.parametrize("target", ["cu128-sm120", "cu130-sm120"])
def test_locks_pin_the_same_torch_as_the_target(target):
    t = tg.load().target(target)
    for name in ("runtime.txt", "builder.txt", "common.txt"):
        lock = (REPO / "locks" / t.torch.lock / name).read_text()
        assert re.search(rf"^torch=={re.escape(t.torch.version)} \\$", lock, re.M), name


def test_image_toolkit_needs_a_tag_reference(tmp_path):
    """The devel image is named by tag; its digest is data in locks/images.toml, never typed here."""
    image = 'image = "nvidia/cuda:12.8.1-devel-ubuntu24.04"'
    assert image in real_text()
    digest = 'image = "nvidia/cuda:12.8.1-devel-ubuntu24.04@sha256:' + "0" * 64 + '"'
    for bad, says in ((digest, "without '@sha256:'.*make pin-images"), ('image = "nvidia/cuda"', "tag reference"),
                      ("", r"\[toolkits.cuda-12_8-image\]: missing required key 'image'")):
        with pytest.raises(ConfigurationError, match=says):
            tg.load(write(tmp_path, real_text().replace(image, bad)))
    pypi = '[toolkits.cuda-13_0-pypi]\nkind = "pypi"'
    assert pypi in real_text()
    text = real_text().replace(pypi, pypi + '\nimage = "nvidia/cuda:13.0.0-devel-ubuntu24.04"')
    with pytest.raises(ConfigurationError, match=r"cuda-13_0-pypi\]: 'image' is only for kind = \"image\""):
        tg.load(write(tmp_path, text))


def test_unknown_target_suggests_the_closest():
    with pytest.raises(ConfigurationError, match="Did you mean 'cu130-sm120'"):
        tg.load().target("cu130-sm12")


@pytest.mark.parametrize("text,match", [
    ("9.9", "not a GPU arch"),
    ("12", "MAJOR.MINOR"),
    ("sm_120", "MAJOR.MINOR"),
])
def test_bad_arch_strings(text, match):
    with pytest.raises(ConfigurationError, match=match):
        tg.Arch.parse(text)


def test_arch_gencode_flags_with_and_without_ptx():
    assert tg.Arch.parse("12.0").gencode_flags() == ["-gencode", "arch=compute_120,code=sm_120"]
    assert tg.Arch.parse("9.0+PTX").gencode_flags() == [
        "-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_90,code=compute_90"]


def test_sm120_needs_cuda_12_8(tmp_path):
    text = real_text().replace('cuda = "12.8.1"', 'cuda = "12.6"')
    with pytest.raises(ConfigurationError, match=r"arch 12.0 needs CUDA >= 12.8.*CUDA 12.6"):
        tg.load(write(tmp_path, text))


def test_arch_override_is_checked_against_the_toolkit():
    t = tg.load().target("cu130-sm120")
    assert [a.sm for a in variants.with_arches(t, "9.0,12.0+PTX").arches] == [90, 120]
    with pytest.raises(ConfigurationError):
        variants.with_arches(t, " , ")


def test_python_override_changes_the_wheel_tag_and_nothing_else():
    t = tg.load().target("cu130-sm90")
    t312 = variants.with_python(t, "3.12")
    assert (t.python, t.cp_tag) == ("3.11", "cp311")
    assert (t312.python, t312.cp_tag) == ("3.12", "cp312")
    assert (t312.name, t312.arches, t312.torch, t312.local_version()) == (t.name, t.arches, t.torch, t.local_version())
    for bad, says in (("3", "major.minor"), ("py312", "major.minor"), ("3.8", "needs Python >= 3.10")):
        with pytest.raises(ConfigurationError, match=says):
            variants.with_python(t, bad)


def test_cuda_major_mismatch_between_toolkit_and_torch(tmp_path):
    text = real_text().replace('[targets.cu130-sm90]\ndescription = "CUDA 13.0 from PyPI, torch 2.11.0, Python 3.11, Hopper (H100, H200)"\ntoolkit = "cuda-13_0-pypi"\ntorch = "cu130"',
                               '[targets.cu130-sm90]\ndescription = "x"\ntoolkit = "cuda-13_0-pypi"\ntorch = "cu128"')
    assert text != real_text()
    with pytest.raises(ConfigurationError, match="differ in major version"):
        tg.load(write(tmp_path, text))


def test_unknown_key_is_named_with_suggestion(tmp_path):
    text = real_text().replace('arches = ["9.0"]', 'arches = ["9.0"]\narchs = ["9.0"]')
    with pytest.raises(ConfigurationError, match=r"\[targets.cu130-sm90\]: unknown key 'archs'. Did you mean 'arches'"):
        tg.load(write(tmp_path, text))


def test_bad_sha256_and_missing_recipe(tmp_path):
    text = real_text().replace('sha256 = "3202758494', 'sha256 = "XYZ')
    with pytest.raises(ConfigurationError, match="not 64 lowercase hex"):
        tg.load(write(tmp_path, text))
    text = real_text().replace('recipes = ["causal-conv1d"]\n\n[targets.cu130-sm90]', 'recipes = ["causal-conv1"]\n\n[targets.cu130-sm90]')
    with pytest.raises(ConfigurationError, match="recipe 'causal-conv1' is not defined. Did you mean 'causal-conv1d'"):
        tg.load(write(tmp_path, text))


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigurationError, match="does not exist"):
        tg.load(tmp_path / "nope.toml")
    with pytest.raises(ConfigurationError, match="not valid TOML"):
        tg.load(write(tmp_path, "[targets\n"))


def test_every_arch_in_table_parses_and_has_a_min_cuda():
    for name, cuda in tg.ARCH_MIN_CUDA.items():
        arch = tg.Arch.parse(name)
        assert arch.min_cuda() == Version(cuda)


def test_recipe_is_pure_data():
    """A second extension is a new table: the loader accepts one without code changes."""
    data = tomllib.loads(real_text())
    extra = """
[recipes.flash-attn]
name = "flash-attn"
version = "2.8.3"
sdist = "flash_attn-2.8.3.tar.gz"
url = "https://example.invalid/flash_attn-2.8.3.tar.gz"
sha256 = "%s"
modules = ["flash_attn_2_cuda"]
[recipes.flash-attn.env]
FLASH_ATTENTION_FORCE_BUILD = "TRUE"
FLASH_ATTN_LOCAL_VERSION = "{local_version}"
""" % ("0" * 64)
    assert "flash-attn" not in data["recipes"]
    text = real_text().replace('recipes = ["causal-conv1d"]\n\n[targets.cu130-sm90]',
                               'recipes = ["causal-conv1d", "flash-attn"]\n\n[targets.cu130-sm90]') + extra
    from pathlib import Path as _P
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        cat = tg.load(write(_P(d), text))
    t = cat.target("cu130-sm120")
    assert [r.key for r in t.recipes] == ["causal-conv1d", "flash-attn"]
    assert dict(t.recipes[1].env)["FLASH_ATTN_LOCAL_VERSION"] == "{local_version}"
    assert t.recipes[1].dist_name == "flash_attn"
