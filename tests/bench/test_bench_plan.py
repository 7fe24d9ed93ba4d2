"""bench/bench_plan.py's fitting on the CPU (its measurements need a GPU): the features it fits are the
memory model's own terms, and its non-negative least squares recovers known coefficients."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from dflash.plan.memory import COEFFS, MicroBatch, activation_terms
from dflash.plan.sizes import drafter_shape, preset_shape

REPO = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_plan", REPO / "bench" / "bench_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_features_weighted_by_the_coefficients_are_the_models_drafter_terms():
    bench = _bench()
    t = preset_shape("27b", layers=8)
    for B, T, N, L in bench.parse_shapes("2:4096:512:5,1:8192:256:2"):
        d = drafter_shape(t, layers=L)
        f = bench.features(t, d, B, T, N)
        terms = activation_terms(t, d, MicroBatch(B, T, N), "bf16")
        model = (terms["drafter_activations"] + terms["weights_in_flight"]) * 1e9
        assert sum(COEFFS[k] * f[k] for k in bench.FEATURES) == pytest.approx(model, rel=1e-9)


def test_nnls_recovers_known_coefficients_and_clamps_negative_ones():
    bench = _bench()
    rows = [[1.0, 2.0, 0.5], [2.0, 1.0, 1.0], [3.0, 3.0, 0.2], [1.0, 0.0, 2.0]]
    truth = [2.0, 0.5, 1.5]
    y = [sum(a * b for a, b in zip(r, truth)) for r in rows]
    assert bench.nnls(rows, y) == pytest.approx(truth)
    assert bench.nnls([[1, 0], [0, 1], [1, 1]], [1, -1, 0.1])[1] == 0.0
