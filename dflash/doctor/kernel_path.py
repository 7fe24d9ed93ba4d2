"""The doctor's kernel-path check: the implementation each GatedDeltaNet op takes in this environment.

The dispatch check reads what transformers resolved when its Qwen3.5 module was imported; this one asks a
built layer. A tiny Qwen3.5 hybrid (3 GatedDeltaNet layers and 1 full-attention layer, hidden 32) is built
the way transformers builds any Qwen3.5 model, on the first visible GPU (else the CPU), and
dflash.model.kernels.op_paths reads what its first GatedDeltaNet layer bound, op by op:

    causal_conv1d_fn                   causal-conv1d | kernels | torch   (prefill, training)
    causal_conv1d_update               causal-conv1d | kernels | torch   (one decoding step)
    chunk_gated_delta_rule             fla           | kernels | torch   (prefill, training)
    fused_recurrent_gated_delta_rule   fla           | kernels | torch   (one decoding step)

`kernels` is a kernel that `kernels.kernelize` bound from the Hugging Face Hub (transformers 5.25 depends
on that package); `torch` is transformers' reference implementation. With a GPU the check passes when no op
takes the torch reference and fails naming the op and the fix; without one it reports skip, each op's
path in the reason (transformers hands only GPU inputs to the packages' kernels). The reason also says
whether the hub may be asked at all: dflash switches hub kernels off (USE_HUB_KERNELS=0) unless the
environment says otherwise, and the image is offline (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import os
from dataclasses import asdict

from dflash.doctor.checks import PACKAGE_FIX, dist_version
from dflash.doctor.verdict import FAIL, PASS, SKIP, CheckResult

# The tiny Qwen3.5 hybrid whose layer is asked (dflash.model.shapes' target shape keys).
PROBE_SHAPE = dict(hidden=32, layers=4, vocab=64, intermediate=64, heads=2, kv_heads=1, head_dim=16,
                   linear_k_heads=2, linear_v_heads=2, linear_head_dim=16)


def hub_state() -> dict:
    """Whether transformers may load kernels from the Hugging Face Hub here, as transformers and
    huggingface_hub themselves read the environment."""
    from huggingface_hub import constants
    from transformers.integrations import hub_kernels
    from transformers.utils.import_utils import is_kernels_available

    installed = is_kernels_available()
    enabled = getattr(hub_kernels, "_kernels_enabled", lambda: True)()
    return {"kernels": dist_version("kernels"), "usable": installed, "enabled": bool(installed and enabled),
            "use_hub_kernels": os.environ.get("USE_HUB_KERNELS"), "hf_hub_offline": bool(constants.HF_HUB_OFFLINE)}


def describe_hub(hub: dict) -> str:
    if not hub["usable"]:
        return "`kernels` not usable (not installed or another version): no hub kernels"
    value = hub["use_hub_kernels"]
    setting = "USE_HUB_KERNELS unset" if value is None else f"USE_HUB_KERNELS={value}"
    switch = f"hub kernels {'allowed' if hub['enabled'] else 'off'} ({setting})"
    offline = "Hub offline (HF_HUB_OFFLINE=1)" if hub["hf_hub_offline"] else "HF_HUB_OFFLINE unset"
    return f"`kernels` {hub['kernels']}: {switch}, {offline}"


def probe_layer(device):
    """The first GatedDeltaNet layer of a tiny Qwen3.5 hybrid built on `device`."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    from dflash.model.kernels import gated_delta_net_layers
    from dflash.model.shapes import qwen35_config

    with torch.device(device):
        model = Qwen3_5ForCausalLM._from_config(qwen35_config(PROBE_SHAPE))
    return gated_delta_net_layers(model)[0]


def check_kernel_path(gpus: list[dict]) -> CheckResult:
    from dflash.model.kernels import TORCH, op_paths

    device = f"cuda:{gpus[0]['index']}" if gpus else "cpu"
    layer = probe_layer(device)
    try:
        paths = op_paths(layer)
    except LookupError as e:
        return CheckResult("kernel-path", FAIL, f"{e}: transformers changed how its GatedDeltaNet dispatches; "
                           "update dflash/model/kernels.py:op_paths")
    hub = hub_state()
    details = {"device": device, "layer": type(layer).__name__, "hub": hub, "ops": [asdict(p) for p in paths]}
    said = "; ".join(p.line() for p in paths) + f". {describe_hub(hub)}"
    if not gpus:
        return CheckResult("kernel-path", SKIP, f"no GPU visible, on cpu: {said}", details=details)
    slow = [p for p in paths if p.path == TORCH]
    if slow:
        fixes = "; ".join(sorted({PACKAGE_FIX.get(p.package, f"install {p.package}") for p in slow}))
        return CheckResult("kernel-path", FAIL, f"on {device} {', '.join(p.op for p in slow)} take(s) the torch "
                           f"reference: {said}. Fix: {fixes}", details=details)
    return CheckResult("kernel-path", PASS, f"on {device}: {said}", details=details)
