"""locks/: the hash-pinned requirement files `make lock` writes from targets.toml, the pins the builder
and runtime locks share (common.txt, one layer for both images), which locks a plain `make lock`
regenerates, and the registry image pins in locks/images.toml."""

from __future__ import annotations

from pathlib import Path

import pytest

from images import pin_file as pf
from wheelbuilder import lock as lk
from wheelbuilder import targets as tg
from wheelbuilder.errors import ConfigurationError
from wheelbuilder.lock import common_requirements, requirement_entries

REPO = Path(__file__).resolve().parents[2]
CU130 = REPO / "locks" / "cu130"
CU128 = REPO / "locks" / "cu128"

BUILDER = """--index-url https://pypi.org/simple

filelock==4.3.1 \\
    --hash=sha256:aaa \\
    --hash=sha256:bbb
    # via torch
nvidia-cuda-nvcc==13.0.88 \\
    --hash=sha256:ccc
Torch==2.11.0 \\
    --hash=sha256:ddd
    # via -r builder.in
typing-extensions==4.16.0 \\
    --hash=sha256:eee
"""
RUNTIME = """--index-url https://pypi.org/simple

filelock==4.3.1 \\
    --hash=sha256:aaa \\
    --hash=sha256:bbb
    # via
    #   huggingface-hub
    #   torch
torch==2.11.0 \\
    --hash=sha256:ddd
transformers==5.24.0 \\
    --hash=sha256:fff
typing-extensions==4.16.0 \\
    --hash=sha256:e0e
"""


def test_only_pins_with_the_same_version_and_hashes_are_shared():
    text = common_requirements("cu130", BUILDER, RUNTIME)
    _, shared = requirement_entries(text)
    # typing-extensions: same version, other hashes -> each stage installs its own.
    assert sorted(shared) == ["filelock", "torch"]
    assert shared["filelock"] == "filelock==4.3.1 \\\n    --hash=sha256:aaa \\\n    --hash=sha256:bbb"
    assert "--index-url https://pypi.org/simple" in text.splitlines()
    assert "# via" not in text


@pytest.mark.parametrize("folder", [CU128, CU130], ids=["cu128", "cu130"])
def test_committed_common_lock_is_current(folder):
    """`make lock` writes common.txt with builder.txt and runtime.txt; a hand edit of either (or a
    forgotten regeneration) shows here instead of as a half-shared image."""
    expected = common_requirements(folder.name, (folder / "builder.txt").read_text(), (folder / "runtime.txt").read_text())
    assert (folder / "common.txt").read_text() == expected


@pytest.mark.parametrize("lock", ["cu128", "cu130"])
def test_committed_lock_inputs_are_what_targets_toml_generates(lock):
    """A pin changed in targets.toml without `make lock` shows here, not as a wrong torch in an image."""
    for name, text in lk.lock_inputs(tg.load(), lock).items():
        assert (REPO / "locks" / lock / f"{name}.in").read_text() == text, f"locks/{lock}/{name}.in: run `make lock`"


def test_cu128_locks_hold_pypi_torch_2_10_with_cuda_12_8_libraries_and_hashes():
    """The default target's torch is PyPI's 2.10.0, a CUDA 12.8 build; nvcc is not a wheel here."""
    locks = {name: requirement_entries((CU128 / f"{name}.txt").read_text()) for name in ("builder", "common", "runtime")}
    for name, (options, entries) in locks.items():
        assert options == ["--index-url https://pypi.org/simple"], name
        assert all("--hash=sha256:" in entry for entry in entries.values()), name
    _, common = locks["common"]
    assert common["torch"].startswith("torch==2.10.0 \\")
    assert common["nvidia-cuda-runtime-cu12"].startswith("nvidia-cuda-runtime-cu12==12.8.90 ")
    assert common["nvidia-cublas-cu12"].startswith("nvidia-cublas-cu12==12.8.4.1 ")
    assert common["triton"].startswith("triton==3.6.0 ")
    _, runtime = locks["runtime"]
    assert {"transformers", "flash-linear-attention", "fla-core"} <= set(runtime) and "transformers" not in common
    assert not any(name.startswith("nvidia-cuda-nvcc") for name in locks["builder"][1])


def test_plain_lock_skips_non_pypi_torch_and_a_named_target_locks_it(monkeypatch, tmp_path, capsys):
    """`make lock` must work where only PyPI is reachable; the PyTorch-index variant is locked when named."""
    locked, compiled = [], []
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # a site constraint is test_lock_constraints.py's subject
    monkeypatch.delenv("PIP_CONSTRAINT", raising=False)
    monkeypatch.delenv("UV_CONSTRAINT", raising=False)
    monkeypatch.setattr(lk, "lock_torch", lambda catalog, lock: locked.append(lock) or [])
    monkeypatch.setattr(lk, "_compile", lambda req, python, index, out, constraints=None: compiled.append(req.name))
    monkeypatch.setattr(lk, "LOCKS", tmp_path)
    (tmp_path / "dev.txt").write_text("")
    catalog = tg.load()
    lk.lock_all(catalog)
    assert locked == ["cu128", "cu130", "cu130-torch2.12", "cu130-torch2.13", "cu130-torch2.14", "cu132-torch2.15"]
    assert compiled == ["dev.in"]
    out = capsys.readouterr().out
    assert "make lock TARGET=cu128-sm120-torch2.11" in out and "make lock TARGET=cu128-sm120-torch2.14" in out
    locked.clear(), compiled.clear()
    lk.lock_all(catalog, target="cu128-sm120-torch2.11")
    assert locked == ["cu128-torch2.11"] and compiled == []


def test_missing_lock_names_the_command_and_the_index():
    variant = tg.load().target("cu128-sm120-torch2.11")
    with pytest.raises(ConfigurationError, match=r"locks/cu128-torch2.11/common.txt is missing.*2.11.0\+cu128 from "
                       r"https://download.pytorch.org/whl/cu128.*`make lock TARGET=cu128-sm120-torch2.11`"):
        lk.require_locks(variant)
    assert lk.require_locks(tg.load().target(None)) == CU128


# ---------------------------------------------------------------------------------------------------
# locks/images.toml
# ---------------------------------------------------------------------------------------------------
DIGEST = "sha256:" + "ab" * 32


def test_committed_image_pins_cover_every_image_toolkit_and_say_their_state():
    """Each devel image a target copies nvcc from has an entry: a digest, or the explicit "unpinned"."""
    pins = pf.read_image_pins()
    assert sorted(pins) == pf.images_to_pin(tg.load()) == ["nvidia/cuda:12.8.1-devel-ubuntu24.04"]
    text = pf.IMAGES_FILE.read_text()
    for ref, pin in pins.items():
        assert (pin.digest is None and 'digest = "unpinned"' in text) or pin.digest.startswith("sha256:")


def test_image_pin_round_trip_and_reference_by_digest(tmp_path):
    path = tmp_path / "images.toml"
    pf.write_image_pins({"nvidia/cuda:12.8.1-devel-ubuntu24.04": pf.ImagePin("nvidia/cuda:12.8.1-devel-ubuntu24.04", None)}, path)
    pin = pf.read_image_pins(path)["nvidia/cuda:12.8.1-devel-ubuntu24.04"]
    assert pin.digest is None
    with pytest.raises(ConfigurationError, match="no digest.*make pin-images"):
        pin.by_digest
    pin = pf.record_image_pin("nvidia/cuda:12.8.1-devel-ubuntu24.04", DIGEST, path)
    again = pf.read_image_pins(path)["nvidia/cuda:12.8.1-devel-ubuntu24.04"]
    assert again == pin and again.pinned_on
    assert again.by_digest == f"nvidia/cuda:12.8.1-devel-ubuntu24.04@{DIGEST}" and again.repository == "nvidia/cuda"
    assert pf.normalize_repository("docker.io/library/debian") == "debian"


@pytest.mark.parametrize("entry,says", [
    ('digest = "sha256:1234"', "neither sha256:<64 hex> nor \"unpinned\""),
    ('digest = "latest"', "neither"),
    ('sha = "unpinned"', "expected a table with digest"),
])
def test_bad_image_pins_name_the_fix(tmp_path, entry, says):
    path = tmp_path / "images.toml"
    path.write_text(f'["nvidia/cuda:12.8.1-devel-ubuntu24.04"]\n{entry}\n')
    with pytest.raises(ConfigurationError, match=says + ".*make pin-images"):
        pf.read_image_pins(path)


def test_a_target_without_an_image_pin_entry_is_refused(tmp_path):
    path = tmp_path / "images.toml"
    path.write_text('["nvidia/cuda:12.9.0-devel-ubuntu24.04"]\ndigest = "unpinned"\n')
    with pytest.raises(ConfigurationError, match="no entry for nvidia/cuda:12.8.1-devel-ubuntu24.04.*make pin-images"):
        pf.image_pin(tg.load().target(None), path)
    with pytest.raises(ConfigurationError, match="pins no registry image"):
        pf.image_pin(tg.load().target("cu130-sm120"), path)


def test_common_lock_holds_torch_and_its_cuda_libraries_and_nothing_stage_specific():
    _, shared = requirement_entries((CU130 / "common.txt").read_text())
    assert shared["torch"].startswith("torch==2.11.0 \\")
    assert {"nvidia-cublas", "nvidia-cudnn-cu13", "nvidia-nccl-cu13", "triton"} <= set(shared)
    assert "nvidia-cuda-nvcc" not in shared and "transformers" not in shared
    assert all("--hash=sha256:" in entry for entry in shared.values())
