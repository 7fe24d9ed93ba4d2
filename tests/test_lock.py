"""locks/<lock>/common.txt: the pins the builder and runtime locks share, installed once in the
Dockerfile's python-torch stage so both images store torch's CUDA libraries in one layer."""

from __future__ import annotations

from pathlib import Path

from wheelbuilder.lock import common_requirements, requirement_entries

REPO = Path(__file__).resolve().parent.parent
CU130 = REPO / "locks" / "cu130"

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


def test_committed_common_lock_is_current():
    """`make lock` writes common.txt with builder.txt and runtime.txt; a hand edit of either (or a
    forgotten regeneration) shows here instead of as a half-shared image."""
    expected = common_requirements("cu130", (CU130 / "builder.txt").read_text(), (CU130 / "runtime.txt").read_text())
    assert (CU130 / "common.txt").read_text() == expected


def test_common_lock_holds_torch_and_its_cuda_libraries_and_nothing_stage_specific():
    _, shared = requirement_entries((CU130 / "common.txt").read_text())
    assert shared["torch"].startswith("torch==2.11.0 \\")
    assert {"nvidia-cublas", "nvidia-cudnn-cu13", "nvidia-nccl-cu13", "triton"} <= set(shared)
    assert "nvidia-cuda-nvcc" not in shared and "transformers" not in shared
    assert all("--hash=sha256:" in entry for entry in shared.values())
