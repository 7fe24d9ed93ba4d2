"""The runtime image of the engines' torch line, dflash-train:cu130-sm120-torch2.14 (vLLM 0.34.0 and SGLang
0.5.23 run torch 2.14), on a real engine: it holds torch 2.14.1 and that line's audited wheel, and its
doctor passes (the CPU set here: versions, import, arch and dispatch pass; the GPU checks skip).

The wheels come from the builder stage (cached by the engine when tests/wheelbuilder built them in the
same run); the image is built once per module.
"""

from __future__ import annotations

import json
import os

import pytest

pytestmark = [pytest.mark.docker, pytest.mark.slow]

NEW_LINE = "cu130-sm120-torch2.14"


@pytest.fixture(scope="module")
def new_line_image() -> str:
    from images.build import DIST_WHEELS, build_image, build_wheels
    from wheelbuilder import targets
    from wheelbuilder.manifest import verify_wheels

    target = targets.load().target(NEW_LINE)
    out = DIST_WHEELS / target.name
    if not (os.environ.get("DFLASH_REUSE_WHEELS") == "1" and (out / "manifest.json").exists() and not verify_wheels(out)):
        build_wheels(target)
    return build_image(target)


def client():
    from images.engine import client as c

    return c()


def test_engines_torch_image_holds_its_torch_and_wheel(new_line_image):
    from images.build import DIST_WHEELS
    from wheelbuilder.manifest import read_manifest

    labels = client().images.get(new_line_image).labels
    assert labels["io.dflash.target"] == NEW_LINE and labels["io.dflash.torch-lock"] == "cu130-torch2.14"
    assert labels["io.dflash.wheel-sha256"] == ",".join(sorted(w.sha256 for w in read_manifest(DIST_WHEELS / NEW_LINE).wheels))
    out = client().containers.run(new_line_image, [
        "python", "-c", "import torch, importlib.metadata as md; print(torch.__version__, md.version('causal-conv1d'))"],
        entrypoint=[], network_mode="none", remove=True).decode().split()
    assert out[0].startswith("2.14.1") and out[1] == "1.7.0+cu130torch2.14sm120"


def test_engines_torch_image_passes_its_doctor(new_line_image):
    raw = client().containers.run(new_line_image, ["doctor", "--json"], network_mode="none", remove=True)
    report = json.loads(raw)
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status["versions"] == "pass" and status["import"] == "pass" and status["arch"] == "pass", report
    assert status["dispatch"] == "pass", report
    for gpu_only in ("kernel-path", "numerics", "triton"):
        assert status[gpu_only] == "skip", status
    assert all(s != "fail" for s in status.values()), report
