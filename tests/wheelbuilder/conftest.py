"""Fixtures of the wheel builder's tests: the new torch line CI builds for real beside cu130-sm120."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The engines' torch (vLLM 0.34.0 pins 2.14.0, SGLang 0.5.23 2.14.1; one wheel serves the minor). The
# other lines build in bench/bench_matrix.py (make bench-matrix).
NEW_LINE = "cu130-sm120-torch2.14"


@pytest.fixture(scope="session")
def new_line_target():
    from wheelbuilder import targets

    return targets.load().target(NEW_LINE)


@pytest.fixture(scope="session")
def new_line_wheels(new_line_target) -> Path:
    """dist/wheels/cu130-sm120-torch2.14/ built by the real builder stage, once per run (its torch layer
    and compile are cached by the engine like cu130-sm120's)."""
    from images.build import DIST_WHEELS, build_wheels
    from wheelbuilder.manifest import verify_wheels

    out = DIST_WHEELS / new_line_target.name
    if os.environ.get("DFLASH_REUSE_WHEELS") == "1" and (out / "manifest.json").exists() and not verify_wheels(out):
        return out
    return build_wheels(new_line_target)
