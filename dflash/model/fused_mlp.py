"""The frozen target's MLPs with SiLU x up and the down projection's FP8 quantisation in one kernel (on a GPU).

transformers runs a Qwen3.5 MLP as `down_proj(act_fn(gate_proj(x)) * up_proj(x))`; with an FP8 target the down
projection then quantises that product (dflash.model.fp8). Eagerly that is three passes over [tokens,
intermediate] tensors: the SiLU (read gate, write), the product (read both, write), the quantisation (read,
write FP8): ~1.85 GB a layer at 8,192 tokens of the 27B shape. `fuse_mlps` gives each such MLP a forward that
runs dflash.model.fp8_triton.silu_mul_quantize instead (read gate and up once, write the FP8 product and its
scales) and hands the result to the down projection's GEMM. The arithmetic and its roundings are eager
torch's, so the FP8 bytes and scales are the same (tests/dflash/model/test_fused_mlp.py).

The forward decides at each call: the fused path needs a SiLU MLP whose down projection is an Fp8Linear on a
quantising GEMM (scaled_mm or triton) and CUDA inputs; anything else (a bf16 target, a CPU, a token count
scaled_mm cannot take) runs transformers' own forward, unchanged. The target runs under no_grad (inference).
"""

from __future__ import annotations

import itertools
import types

import torch
import torch.nn.functional as F

from dflash.model.fp8 import Fp8Linear


def _silu(act) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def mlp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The gated SiLU MLPs of `model` (gate_proj, up_proj, down_proj and a SiLU act_fn), in module order."""
    return [m for m in model.modules()
            if all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj")) and _silu(getattr(m, "act_fn", None))]


def fused_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    down = self.down_proj
    lead, k = gate.shape[:-1], gate.shape[-1]
    m = gate.numel() // k
    if (not isinstance(down, Fp8Linear) or not gate.is_cuda or torch.is_grad_enabled()
            or not down.takes_quantized(m)):
        return down(F.silu(gate) * up)
    from dflash.model.fp8_triton import silu_mul_quantize

    xq, xs = silu_mul_quantize(gate.reshape(m, k), up.reshape(m, k))
    return down.forward_quantized(xq, xs, gate.dtype).view(*lead, down.out_features)


def fuse_mlps(model: torch.nn.Module) -> int:
    """Give every gated SiLU MLP of `model` the fused forward when its weights are on a GPU; the number changed
    (0 on a CPU, and for MLPs that already have it)."""
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    if first is None or first.device.type != "cuda":
        return 0
    done = 0
    for module in mlp_modules(model):
        if getattr(module.forward, "__func__", None) is not fused_forward:
            module.forward = types.MethodType(fused_forward, module)
            done += 1
    return done
