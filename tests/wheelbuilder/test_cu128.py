"""The default target cu128-sm120, checked as far as a machine without a container registry can.

Its nvcc 12.8 comes from NVIDIA's devel image (no PyPI wheel and no Debian release carries it), so its
wheel is built only where that image can be pulled. Everything else is checked here:

- build args and Dockerfile stages of its builder, the devel image named by its pin (locks/images.toml);
- the pin's checks and the error when the image cannot be pulled (no registry);
- its locks install with --require-hashes into clean venvs; that venv imports torch/transformers/fla,
  reports CUDA 12.8, passes the builder's plan (with a test-double nvcc 12.8) and the doctor's versions
  check up to the one thing it lacks, the causal-conv1d wheel;
- its runtime image builds on the offline Debian base up to the wheel (stage runtime-env), and the same
  checks pass inside it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from images import pin_file as pf
from wheelbuilder import targets as tg
from wheelbuilder.errors import ToolchainError

REPO = Path(__file__).resolve().parents[2]
DEVEL = "nvidia/cuda:12.8.1-devel-ubuntu24.04"
DIGEST = "sha256:" + "5e" * 32


def cu128_runtime_pin(package: str) -> str:
    """The version locks/cu128/runtime.txt pins for `package`."""
    from wheelbuilder.lock import resolved_version

    return resolved_version((REPO / "locks" / "cu128" / "runtime.txt").read_text(), package)


@pytest.fixture
def target() -> tg.Target:
    return tg.load().target(None)


@pytest.fixture
def pins_file(tmp_path, monkeypatch) -> Path:
    """locks/images.toml redirected to a temporary copy, so tests can pin and unpin freely."""
    path = tmp_path / "images.toml"
    path.write_text(pf.IMAGES_FILE.read_text())
    monkeypatch.setattr(pf, "IMAGES_FILE", path)
    return path


def fake_cuda_home(root: Path, release: str) -> Path:
    """Test double of a CUDA home: an `nvcc` that only answers --version like CUDA 12.8.1's nvcc."""
    home = root / f"cuda-{release}"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release[:4]}, V{release}'\n")
    nvcc.chmod(0o755)
    return home


# ---------------------------------------------------------------------------------------------------
# Build plan: args, stages, the pin
# ---------------------------------------------------------------------------------------------------
def test_builder_args_name_the_devel_image_by_its_pin_and_every_arg_is_declared(target, pins_file):
    from images.build import base_args, wheels_spec

    text = (REPO / "Dockerfile").read_text()
    stages = set(re.findall(r"^FROM \S+ AS (\S+)", text, re.M))
    declared = set(re.findall(r"^ARG (\w+)", text, re.M))
    args = wheels_spec(target, Path("/tmp/out")).build_args
    assert args["TOOLKIT_KIND"] == "image" and f"toolkit-{args['TOOLKIT_KIND']}" in stages
    assert args["BUILDER_BASE"] == args["RUNTIME_BASE"] == "dflash-base:bookworm"
    assert args["CUDA_IMAGE_HOME"] == "/usr/local/cuda-12.8" and args["TORCH_LOCK"] == "cu128"
    assert set(args) <= declared and set(base_args(target, "runtime-os")) <= declared
    assert re.search(r"^FROM toolkit-\$\{TOOLKIT_KIND\} AS toolkit$", text, re.M)
    assert re.search(r"^FROM \$\{CUDA_IMAGE\} AS cuda-image$", text, re.M)
    assert re.search(rf"^ARG CUDA_IMAGE={re.escape(DEVEL)}$", text, re.M)  # the default target's image
    # Unpinned: the plan names the tag (the first pull records the digest); pinned: the digest.
    assert args["CUDA_IMAGE"] == (pf.image_pin(target).by_digest if pf.image_pin(target).digest else DEVEL)
    pf.record_image_pin(DEVEL, DIGEST)
    assert wheels_spec(target, Path("/tmp/out")).build_args["CUDA_IMAGE"] == f"{DEVEL}@{DIGEST}"


def test_pypi_targets_never_name_a_devel_image(pins_file):
    from images.build import wheels_spec

    args = wheels_spec(tg.load().target("cu130-sm120"), Path("/tmp/out")).build_args
    assert args["TOOLKIT_KIND"] == "pypi" and "CUDA_IMAGE" not in args


def test_repo_digests_must_hold_the_pinned_digest():
    from images.pins import check_repo_digests

    pin = pf.ImagePin(DEVEL, DIGEST)
    check_repo_digests(pin, [f"nvidia/cuda@{DIGEST}", "mirror.example/cuda@sha256:" + "0" * 64])
    other = "sha256:" + "1" * 64
    with pytest.raises(ToolchainError, match=rf"not the pinned one: its RepoDigests are nvidia/cuda@{other}; "
                       rf"locks/images.toml pins {DIGEST}.*docker pull {re.escape(pin.by_digest)}.*make pin-images"):
        check_repo_digests(pin, [f"nvidia/cuda@{other}"])
    with pytest.raises(ToolchainError, match="none \\(an image loaded from an archive carries none\\)"):
        check_repo_digests(pin, [])


def test_first_pull_records_the_digest_and_later_builds_check_it(target, pins_file, monkeypatch):
    """The engine is replaced by a dict of local images -> RepoDigests; the pin logic is the real one."""
    from images import pins

    local = {DEVEL: [f"docker.io/nvidia/cuda@{DIGEST}"]}
    pulled = []
    monkeypatch.setattr(pins, "image_exists", lambda ref: ref in local or ref == f"nvidia/cuda@{DIGEST}")
    monkeypatch.setattr(pins, "repo_digests", lambda ref: [pf.normalize_repository(d) for d in local[DEVEL]])
    monkeypatch.setattr(pins, "_pull", lambda ref, t, c: pulled.append(ref))
    pf.write_image_pins({DEVEL: pf.ImagePin(DEVEL, None)})
    assert pins.ensure_toolkit_image(target) == f"{DEVEL}@{DIGEST}"
    assert pf.read_image_pins()[DEVEL].digest == DIGEST and pulled == []
    assert pins.ensure_toolkit_image(target) == f"{DEVEL}@{DIGEST}"  # now verified against the pin
    local[DEVEL] = ["nvidia/cuda@sha256:" + "2" * 64]  # the engine's copy is other bytes
    with pytest.raises(ToolchainError, match="not the pinned one"):
        pins.ensure_toolkit_image(target)


@pytest.mark.docker
def test_an_unpullable_devel_image_fails_at_once_naming_it_why_and_the_registry_free_targets(tmp_path, pins_file):
    """`.invalid` never resolves, so the pull fails as it does on a machine without a registry."""
    import time

    from images.pins import ensure_toolkit_image, registry_free_targets

    image = "registry.invalid/nvidia/cuda:12.8.1-devel-ubuntu24.04"
    text = (REPO / "targets.toml").read_text().replace(f'image = "{DEVEL}"', f'image = "{image}"')
    (tmp_path / "targets.toml").write_text(text)
    catalog = tg.load(tmp_path / "targets.toml")
    pf.write_image_pins({image: pf.ImagePin(image, None)})
    started = time.monotonic()
    with pytest.raises(ToolchainError) as e:
        ensure_toolkit_image(catalog.target("cu128-sm120"), catalog)
    assert time.monotonic() - started < 60
    message = str(e.value)
    assert f"cannot pull {image}" in message and "nvcc 12.8.1" in message
    assert "no PyPI wheel or Debian release carries" in message
    pypi = registry_free_targets(catalog)
    assert {"cu130-sm120", "cu130-sm90"} <= set(pypi) and "cu128-sm120" not in pypi
    assert f"comes from PyPI: {', '.join(pypi)} (e.g. `make wheels TARGET=cu130-sm120`)" in message
    assert pf.read_image_pins()[image].digest is None  # nothing recorded from a failed pull


# ---------------------------------------------------------------------------------------------------
# The locks in clean venvs
# ---------------------------------------------------------------------------------------------------
def uv_venv(path: Path, *requirements: Path) -> Path:
    """A clean venv with `requirements` installed by uv with --require-hashes, as hard links from uv's
    cache (as `make venv` does), so the multi-GB CUDA 12.8 wheels cost disk once per machine."""
    uv = Path(sys.executable).parent / "uv"
    assert uv.is_file(), "uv comes with the dev lock: run `make venv`"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)  # with pip: the builder runs `pip wheel`
    cmd = [str(uv), "pip", "install", "--quiet", "--python", str(path / "bin" / "python"), "--link-mode", "hardlink",
           "--require-hashes"]
    for req in requirements:
        cmd += ["-r", str(req)]
    subprocess.run(cmd, check=True)
    return path / "bin" / "python"


@pytest.fixture(scope="module")
def cu128_runtime_venv(tmp_path_factory) -> Path:
    return uv_venv(tmp_path_factory.mktemp("cu128") / "runtime", REPO / "locks/cu128/runtime.txt")


def doctor_versions(python: list[str], env: dict | None = None) -> dict:
    """The doctor's versions check (`dflash doctor --quick --json`) as run by `python`."""
    out = subprocess.run([*python, "-c", "import sys; from dflash.cli import main; sys.exit(main())",
                          "doctor", "--quick", "--json"], capture_output=True, text=True, env=env, timeout=300)
    report = json.loads(out.stdout)
    return next(c for c in report["checks"] if c["name"] == "versions")


def assert_versions_are_the_locks_and_only_the_wheel_is_missing(check: dict) -> None:
    versions = check["details"]["versions"]
    assert versions["torch"] == "2.10.0+cu128" and versions["cuda_runtime"] == "12.8"
    assert (versions["transformers"], versions["fla-core"], versions["triton"]) == (
        cu128_runtime_pin("transformers"), "0.6.0", "3.6.0")
    # The only failure: the wheel this machine cannot build (no nvcc 12.8 without a registry).
    assert check["status"] == "fail" and check["reason"].startswith("not installed: causal-conv1d. Seen: ")


@pytest.mark.slow
def test_runtime_lock_installs_with_hashes_and_reports_cuda_12_8(cu128_runtime_venv):
    probe = ("import torch, transformers, fla, triton; "
             "print(torch.__version__, torch.version.cuda, transformers.__version__, fla.__version__, triton.__version__)")
    out = subprocess.run([str(cu128_runtime_venv), "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["2.10.0+cu128", "12.8", cu128_runtime_pin("transformers"), "0.6.0", "3.6.0"]


@pytest.mark.slow
def test_doctor_versions_check_runs_in_the_runtime_venv(cu128_runtime_venv):
    env = dict(os.environ, PYTHONPATH=str(REPO), DFLASH_TARGET="cu128-sm120")
    assert_versions_are_the_locks_and_only_the_wheel_is_missing(doctor_versions([str(cu128_runtime_venv)], env))


@pytest.mark.slow
def test_builder_lock_installs_with_hashes_and_passes_the_builder_plan(tmp_path):
    """The builder lock's torch is the one the plan demands; nvcc is a test double of CUDA 12.8.1's
    (the real one is in the devel image), so this checks the plan, not a compile."""
    python = uv_venv(tmp_path / "builder", REPO / "locks/cu128/builder.txt")
    home = fake_cuda_home(tmp_path, "12.8.93")
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_HOME=str(home))
    out = subprocess.run([str(python), "-m", "wheelbuilder", "build", "--target", "cu128-sm120", "--dry-run",
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    plan = out.stdout + out.stderr
    assert "build plan for cu128-sm120" in plan
    for key, value in (("torch", "2.10.0+cu128 (CUDA 12.8)"), ("nvcc", "12.8.93"), ("arches", "12.0"),
                       ("local_version", "cu128torch2.10sm120"), ("python", "3.11")):
        assert re.search(rf"^  {key} +{re.escape(value)}$", plan, re.M), key


# ---------------------------------------------------------------------------------------------------
# The runtime image up to the wheel, on the offline base
# ---------------------------------------------------------------------------------------------------
@pytest.mark.docker
@pytest.mark.slow
def test_runtime_env_stage_builds_on_the_offline_base_and_passes_the_versions_check(target):
    """Everything of dflash-train:cu128-sm120 but the wheel: the python-torch layer (locks/cu128/common.txt)
    and the runtime lock on dflash-base:bookworm, without a registry. The wheel's own step (verify,
    install, `dflash doctor --quick` at build time) is the one the cu130 image tests run."""
    from images.build import BuildSpec, _prepare, base_args
    from images.engine import client
    from common.cmd import run

    tag = f"dflash-train-env:cu128-sm120-{uuid.uuid4().hex[:8]}"
    log = _prepare(target, "the cu128 runtime environment", "runtime-env-cu128-sm120.log")
    spec = BuildSpec(stage="runtime-env", build_args=base_args(target, "runtime-os"), tag=tag)
    run(spec.command(), env=dict(os.environ, DOCKER_BUILDKIT="1"), log=log)
    try:
        check = doctor_versions(["docker", "run", "--rm", "--network", "none", "--entrypoint", "python", tag])
        assert_versions_are_the_locks_and_only_the_wheel_is_missing(check)
        env = client().images.get(tag).attrs["Config"]["Env"]
        assert "DFLASH_TARGET=cu128-sm120" in env
    finally:
        client().images.remove(tag, noprune=True)
