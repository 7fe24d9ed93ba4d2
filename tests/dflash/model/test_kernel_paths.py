"""Which implementation each GatedDeltaNet op of a built layer takes (dflash.model.kernels.op_paths), read
from what transformers 5.25 and `kernels` bound, and checked against what a call really runs."""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
from pathlib import Path

import pytest
import torch

from dflash.doctor.kernel_path import probe_layer
from dflash.model.kernels import (GDN_OPS, HUB, TORCH, gated_delta_net_layers, kernel_functions, op_paths,
                                  route_kernels_by_device)

HAS_CONV = importlib.util.find_spec("causal_conv1d") is not None
HAS_FLA = importlib.util.find_spec("fla") is not None


def qwen35_module():
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen

    return qwen


def test_kernel_functions_read_through_the_kernels_function_modules():
    """With `kernels` installed each dispatched function is `kernels`' function module, not a function;
    the reader still finds transformers' wrapper inside and what it resolved."""
    pytest.importorskip("kernels")
    qwen = qwen35_module()
    held = inspect.unwrap(qwen.torch_chunk_gated_delta_rule)  # under a router of dflash's, once a target loaded
    assert getattr(type(held), "kernel_layer_name", None) == "chunk_gated_delta_rule"
    found = {fn.name: fn for fn in kernel_functions(qwen)}
    assert set(found) == {"causal_conv1d_fn", "causal_conv1d_update", "chunk_gated_delta_rule",
                          "fused_recurrent_gated_delta_rule"}
    assert found["chunk_gated_delta_rule"].torch_function.__name__ == "torch_chunk_gated_delta_rule"
    assert found["chunk_gated_delta_rule"].fast is HAS_FLA
    assert found["causal_conv1d_fn"].fast is HAS_CONV
    if HAS_FLA:  # transformers 5.25 hands fla only accelerator inputs
        assert "cuda" in found["chunk_gated_delta_rule"].devices and "cpu" not in found["chunk_gated_delta_rule"].devices


def _op_inputs() -> dict[str, tuple[tuple, dict]]:
    """Small CPU inputs for each GatedDeltaNet op, as the layer calls it (B=1, T=6, 2 heads of 8)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, 2, 8, generator=g) for _ in range(3))
    gate, beta = -torch.rand(1, 6, 2, generator=g), torch.rand(1, 6, 2, generator=g)
    x, weight = torch.randn(1, 4, 6, generator=g), torch.randn(4, 3, generator=g)
    delta = dict(g=gate, beta=beta, use_qk_l2norm_in_kernel=True)
    return {
        "causal_conv1d_fn": ((x, weight, None), dict(activation="silu")),
        "causal_conv1d_update": ((x[..., :1], torch.randn(1, 4, 3, generator=g), weight, None),
                                 dict(activation="silu")),
        "chunk_gated_delta_rule": ((q, k, v), delta),
        "fused_recurrent_gated_delta_rule": ((q[:, :1], k[:, :1], v[:, :1]),
                                             dict(g=gate[:, :1], beta=beta[:, :1], use_qk_l2norm_in_kernel=True,
                                                  initial_state=torch.randn(1, 2, 8, 8, generator=g),
                                                  output_final_state=True)),
    }


def _copy(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Fresh copies (causal_conv1d_update writes its conv state in place)."""
    clone = lambda a: a.clone() if isinstance(a, torch.Tensor) else a  # noqa: E731
    return tuple(clone(a) for a in args), {n: clone(a) for n, a in kwargs.items()}


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def test_on_cpu_every_op_takes_the_torch_reference_and_that_is_what_runs():
    """Read against transformers' own Qwen3.5 module: each op names that module's reference, and the layer's
    own copy of the op (what its forward calls), given CPU inputs, computes exactly that reference (with fla
    or causal-conv1d resolved, a call that reached their kernels would fail on the CPU)."""
    layer = probe_layer("cpu")
    paths = {p.op: p for p in op_paths(layer)}
    assert list(paths) == list(GDN_OPS) and {p.path for p in paths.values()} == {TORCH}
    qwen = qwen35_module()
    module_fns = {fn.name: fn for fn in kernel_functions(qwen)}
    assert set(module_fns) == set(GDN_OPS)
    own = vars(layer).get("_kernel_funcs", {})  # the layer's own copies (with `kernels` installed)
    for op, (args, kwargs) in _op_inputs().items():
        fn, path = module_fns[op], paths[op]
        assert path.runs == f"{qwen.__name__}.{fn.torch_function.__qualname__}" and path.package == fn.package
        fast = HAS_CONV if fn.package == "causal_conv1d" else HAS_FLA
        assert fn.fast is fast and ("cpu inputs" in path.why) is fast and ("not installed" in path.why) is not fast
        call = own.get(op, getattr(qwen, fn.attr))
        (a, kw), (ref_a, ref_kw) = _copy(args, kwargs), _copy(args, kwargs)
        assert torch.equal(_first(call(*a, **kw)), _first(fn.torch_function(*ref_a, **ref_kw))), op


def test_an_op_the_module_does_not_dispatch_is_refused():
    with pytest.raises(LookupError, match="dispatches no kernel function named no_such_op"):
        op_paths(probe_layer("cpu"), ops=("no_such_op",))


PROBE_KERNEL = '''
import torch
from torch import nn

CALLS = []


class ChunkGatedDeltaRule(nn.Module):
    """A stand-in kernel: zeros of the value's shape, and a note of each call."""

    def forward(self, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
        CALLS.append(tuple(value.shape))
        return torch.zeros_like(value), None
'''


def write_local_kernel(root: Path) -> Path:
    """A kernel repository on disk in the layout `kernels` loads (build/<variant>/metadata.json and the
    package): one noarch variant for any torch, one layer that stands in for chunk_gated_delta_rule."""
    variant = root / "build" / "torch-universal"
    (variant / "dflash_probe_kernel").mkdir(parents=True)
    (variant / "metadata.json").write_text(json.dumps({
        "name": "dflash-probe-kernel", "id": "dflash_probe_kernel", "version": 1, "license": "Apache-2.0",
        "python-depends": [], "backend": {"type": "cpu"}}))
    (variant / "dflash_probe_kernel" / "__init__.py").write_text("from . import layers\n")
    (variant / "dflash_probe_kernel" / "layers.py").write_text(PROBE_KERNEL)
    return root


def test_a_kernel_that_kernelize_binds_is_named_and_is_what_runs(tmp_path):
    """`kernels.kernelize` with a local repository (nothing from the Hub) rebinds the layers' own copy of
    chunk_gated_delta_rule: op_paths names `kernels` and the repository, and a forward runs that kernel in
    every GatedDeltaNet layer, also with the module routed as a loaded Target routes it; the convolution keeps
    its path, and a model built afterwards is untouched."""
    kernels = pytest.importorskip("kernels")
    from transformers import Qwen3_5ForCausalLM

    from dflash.doctor.kernel_path import PROBE_SHAPE
    from dflash.model.shapes import qwen35_config

    route_kernels_by_device(qwen35_module())  # what Target.load does: its routers must not bypass the binding
    repo = write_local_kernel(tmp_path / "probe-kernel")
    model = Qwen3_5ForCausalLM._from_config(qwen35_config(PROBE_SHAPE))
    mapping = {"chunk_gated_delta_rule": {"cpu": kernels.LocalLayerRepository(
        repo_path=repo, layer_name="ChunkGatedDeltaRule")}}
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")
    layers = gated_delta_net_layers(model)
    paths = {p.op: p for p in op_paths(layers[0])}
    assert paths["chunk_gated_delta_rule"].path == HUB and str(repo) in paths["chunk_gated_delta_rule"].runs
    assert paths["causal_conv1d_fn"].path == TORCH
    calls = sys.modules["dflash_probe_kernel"].layers.CALLS
    model(torch.randint(0, PROBE_SHAPE["vocab"], (1, 8)), use_cache=False)
    assert len(calls) == len(layers) == 3
    assert {p.path for p in op_paths(probe_layer("cpu"))} == {TORCH}


def test_kernel_functions_pass_over_a_closure_with_an_empty_cell():
    """torch.compile leaves `__compiled_fn_*` globals with empty closure cells in the module whose code it
    compiled (the modeling module, once the target's norms are compiled); reading that module's dispatch
    points must not fail on them (it did: "ValueError: Cell is empty" at the next Target built)."""
    import types

    from dflash.model.kernels import kernel_functions

    def unbound():
        def reads_later():
            return later  # noqa: F821  bound after return: the cell stays empty
        return reads_later
        later = 1  # noqa: F841

    module = types.ModuleType("compiled_module")
    module.__compiled_fn_1 = unbound()
    assert kernel_functions(module) == []
