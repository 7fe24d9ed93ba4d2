"""The target's RMSNorms compiled on a GPU (dflash.model.fused_norms): which modules, nothing on a CPU, and on a
GPU tapped states as close to a float64 reference as the eager norms give."""

from __future__ import annotations

import pytest
import torch

import dflash.model.target as target_module
from dflash.model.fused_norms import compile_norms, norm_modules
from dflash.model.target import Target
from tests.support.dflash_tiny import save_tiny_target


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5")


def test_the_norms_are_the_layers_the_gated_and_the_qk_norms_and_none_compile_on_a_cpu(tiny_path):
    target = Target.load(tiny_path)
    types = target.config.layer_types
    linear, full = types.count("linear_attention"), types.count("full_attention")
    names = [type(m).__name__ for m in norm_modules(target.model)]
    # two per decoder layer, the final norm, a gated norm per GatedDeltaNet layer, q/k norms per attention layer
    assert len(names) == 2 * len(types) + 1 + linear + 2 * full, names
    assert names.count("Qwen3_5RMSNormGated") == linear
    assert compile_norms(target.model) == 0
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in norm_modules(target.model))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.gpu
def test_compiled_norms_keep_the_tapped_states_next_to_a_float64_reference(tiny_path, monkeypatch):
    """bf16 on the GPU, packed-free [2, 130] ids: compiled and eager norms against a float64 CPU pass."""
    ids = torch.randint(4, 96, (2, 130), generator=torch.Generator().manual_seed(0))
    layers = list(range(8))
    ref = Target.load(tiny_path, dtype=torch.float64, layer_ids=layers).context(ids)
    compiled = Target.load(tiny_path, device="cuda", dtype=torch.bfloat16, layer_ids=layers)
    assert all(getattr(m, "_compiled_call_impl", None) is not None for m in norm_modules(compiled.model))
    out = compiled.context(ids.cuda()).cpu()
    monkeypatch.setattr(target_module, "compile_norms", lambda model: 0)
    eager = Target.load(tiny_path, device="cuda", dtype=torch.bfloat16, layer_ids=layers).context(ids.cuda()).cpu()
    err_compiled, err_eager, apart = _rel(out, ref), _rel(eager, ref), _rel(out, eager)
    print(f"\nrelative L2 vs float64: compiled {err_compiled:.3e}, eager {err_eager:.3e}; compiled vs eager {apart:.3e}")
    assert err_compiled <= 1.25 * err_eager + 1e-4, (err_compiled, err_eager)
    assert apart <= 1e-2, apart
