"""The doctor's kernel-path check (dflash/doctor/kernel_path.py): the path each GatedDeltaNet op takes here,
and whether transformers may ask the Hub for a kernel."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from dflash.doctor import doctor
from dflash.doctor import kernel_path as kp
from dflash.doctor.verdict import FAIL, PASS, SKIP

HAS_CONV = importlib.util.find_spec("causal_conv1d") is not None
HAS_FLA = importlib.util.find_spec("fla") is not None


def test_without_a_gpu_it_skips_naming_the_torch_reference_for_every_op_the_real_module_dispatches():
    """The ops named are the four GatedDeltaNet kernel functions of transformers' own Qwen3.5 module, each
    with the torch reference that module holds: on the CPU transformers never hands inputs to a package."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen

    from dflash.model.kernels import kernel_functions

    dispatched = {fn.name: fn for fn in kernel_functions(qwen)}
    assert set(dispatched) == {"causal_conv1d_fn", "causal_conv1d_update", "chunk_gated_delta_rule",
                               "fused_recurrent_gated_delta_rule"}
    r = kp.check_kernel_path([])
    assert r.status == SKIP and not r.blocks
    assert r.reason.startswith("no GPU visible, on cpu: causal_conv1d_fn -> torch (")
    for op in ("causal_conv1d_update", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):
        assert f"; {op} -> torch (" in r.reason
    ops = {op["op"]: op for op in r.details["ops"]}
    assert list(ops) == sorted(dispatched)  # every op, in a stable order
    for name, fn in dispatched.items():
        assert ops[name]["path"] == "torch" and ops[name]["package"] == fn.package
        reference = fn.torch_function
        assert ops[name]["runs"] == f"{reference.__module__}.{reference.__qualname__}"
        assert ("cpu inputs" in ops[name]["why"]) is fn.fast
    assert r.details["device"] == "cpu" and r.details["layer"] == "Qwen3_5GatedDeltaNet"


def test_it_says_whether_the_hub_may_be_asked():
    """dflash's start-up switched hub kernels off (the tests import dflash); the reason says so."""
    assert os.environ["USE_HUB_KERNELS"] == "0"
    hub = kp.hub_state()
    assert hub["enabled"] is False and hub["use_hub_kernels"] == "0"
    assert "hub kernels off (USE_HUB_KERNELS=0)" in kp.check_kernel_path([]).reason
    on = dict(hub, usable=True, enabled=True, use_hub_kernels=None, kernels="0.19.1", hf_hub_offline=True)
    assert kp.describe_hub(on) == "`kernels` 0.19.1: hub kernels allowed (USE_HUB_KERNELS unset), Hub offline " \
                                  "(HF_HUB_OFFLINE=1)"
    assert kp.describe_hub(dict(on, usable=False)).startswith("`kernels` not usable")


def test_hub_state_follows_the_environment_as_transformers_reads_it(monkeypatch):
    pytest.importorskip("kernels")
    monkeypatch.setenv("USE_HUB_KERNELS", "1")
    assert kp.hub_state()["enabled"] is True
    monkeypatch.setenv("USE_HUB_KERNELS", "off")
    assert kp.hub_state()["enabled"] is False


def test_quick_leaves_it_out_and_a_full_run_places_it_after_dispatch():
    quick = doctor.run_checks(doctor.Options(quick=True))
    by = {c.name: c for c in quick.checks}
    assert by["kernel-path"].status == SKIP and by["kernel-path"].reason == "skipped by --quick"
    names = [c.name for c in quick.checks]
    assert names.index("kernel-path") == names.index("dispatch") + 1


@pytest.mark.gpu
def test_on_a_gpu_it_names_the_packages_kernels_and_fails_on_the_reference():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    r = kp.check_kernel_path([{"index": 0, "name": torch.cuda.get_device_name(0), "sm": 0}])
    paths = {op["op"]: op["path"] for op in r.details["ops"]}
    conv, fla = "causal-conv1d" if HAS_CONV else "torch", "fla" if HAS_FLA else "torch"
    assert paths == {"causal_conv1d_fn": conv, "causal_conv1d_update": conv,
                     "chunk_gated_delta_rule": fla, "fused_recurrent_gated_delta_rule": fla}
    assert r.status == (PASS if HAS_CONV and HAS_FLA else FAIL)
    if not HAS_CONV:
        assert "causal_conv1d_fn" in r.reason and "make wheels" in r.reason
