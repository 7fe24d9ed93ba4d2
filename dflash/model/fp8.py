"""Fine-grained FP8 linear layers: the block-quantised weights Qwen publishes, and the GEMM that runs them.

The layout (transformers' FineGrainedFP8, `quantization_config.quant_method == "fp8"`):

    weight            [N, K] float8_e4m3fn        W / s, clamped to +-448
    weight_scale_inv  [ceil(N/128), ceil(K/128)]  float32, one s per 128 x 128 block (its max |W| / 448)

A partial block at the right or bottom edge (N or K not a multiple of 128) has a scale of its own over the
rows and columns it has, as transformers' FP8Linear allocates it (ceil division). Activations are quantised
per token and per 128 columns at run time ("dynamic"): x[m, k] ~ xq[m, k] * a_s[m, k // 128].

GEMMs (`GEMMS`; `pick_gemm(device)` chooses; `Fp8Linear.gemm` is the seam the benchmark turns):

    scaled_mm  torch.nn.functional.scaled_mm with (BlockWise1x128, BlockWise128x128) scales: cuBLASLt's
               block-scaled FP8 kernels. torch 2.11 runs this recipe on SM 9.0 only (aten ScaledBlas.cpp
               `_check_deepseek_support`: "only supported in CUDA for SM90", cublasLt >= 12.9), and needs
               K a multiple of 512 (the scale layout pads K/128 to a multiple of 4) and N of 128.
    triton     dflash.model.fp8_triton: a Triton block-FP8 GEMM with the same scales (SM 8.9 and newer,
               SM 12.0 included, where torch has no block-scaled recipe).
    dequant    the weight dequantised to the activation dtype, then F.linear: any device, the reference.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
GEMMS = ("scaled_mm", "triton", "dequant")


# --------------------------------------------------------------------------------------------------
# Weights: [N, K] <-> (fp8 [N, K], fp32 scales [ceil(N/128), ceil(K/128)])
# --------------------------------------------------------------------------------------------------
def _padded_blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[N, K] -> [Nb, bn, Kb, bk] float32, zero-padded to whole blocks."""
    n, k = w.shape
    bn, bk = block
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    return padded.view(nb, bn, kb, bk)


def quantize_weight(w: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weight -> (weight [N, K] float8_e4m3fn, weight_scale_inv [ceil(N/bn), ceil(K/bk)] float32).

    Each block's scale is its max |w| / 448 (an all-zero block gets 1), so its largest element lands on
    e4m3's largest finite value; dequantising multiplies by the same float32 scale."""
    if w.dim() != 2:
        raise ValueError(f"a block-quantised weight is 2-D, got shape {tuple(w.shape)}")
    n, k = w.shape
    blocks = _padded_blocks(w, block)
    amax = blocks.abs().amax(dim=(1, 3))  # [Nb, Kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.view(scale.shape[0] * block[0], scale.shape[1] * block[1])[:n, :k].contiguous()
    return q, scale.contiguous()


def dequantize_weight(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                      block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """(fp8 [N, K], scales [ceil(N/bn), ceil(K/bk)]) -> [N, K] in `dtype` (partial edge blocks included)."""
    n, k = q.shape
    full = scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return (q.float() * full).to(dtype)


def quantize_activation(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] activations -> (xq [M, K] fp8, scales [M, ceil(K/group)] float32): dynamic, per token and group.
    The reference: the GPU GEMMs quantise with dflash.model.fp8_triton's one-pass kernel, the same numbers."""
    m, k = x.shape
    kb = math.ceil(k / group)
    padded = F.pad(x.float(), (0, kb * group - k)).view(m, kb, group)
    scale = (padded.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    xq = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(m, kb * group)[:, :k]
    return xq.contiguous(), scale


# --------------------------------------------------------------------------------------------------
# The GEMMs: y [M, N] = x [M, K] @ W^T, W given as (fp8 weight, block scales)
# --------------------------------------------------------------------------------------------------
def gemm_dequant(x, weight, scale_inv, bias=None):
    return F.linear(x, dequantize_weight(weight, scale_inv, x.dtype), bias)


def scaled_mm_fits(n: int, k: int) -> bool:
    """Whether torch's block-scaled recipe takes a [N, K] weight (cuBLASLt's layout: K/128 a multiple of 4)."""
    return k % (4 * BLOCK) == 0 and n % BLOCK == 0


def scaled_mm_quantized(xq, xs, weight, scale_inv, out_dtype, bias=None):
    """The block-scaled GEMM of activations already quantised (xq [M, K] fp8, M a multiple of 16; xs [M, K/128]
    column-major) on SM 9.0: torch.nn.functional.scaled_mm with (BlockWise1x128, BlockWise128x128) scales."""
    from torch.nn.functional import ScalingType

    y = F.scaled_mm(xq, weight.t(), xs, ScalingType.BlockWise1x128,
                    scale_inv.t(), ScalingType.BlockWise128x128, output_dtype=out_dtype)
    return y + bias if bias is not None else y


def gemm_scaled_mm(x, weight, scale_inv, bias=None):
    """torch.nn.functional.scaled_mm, activations 1x128 and weights 128x128 (SM 9.0); the activations are
    quantised by dflash.model.fp8_triton (its scales come column-major, the layout scaled_mm reads)."""
    from dflash.model.fp8_triton import quantize_activation as quantize_on_gpu

    m = x.shape[0]
    pad = (-m) % 16  # the FP8 GEMMs take M in multiples of 16
    xq, xs = quantize_on_gpu(F.pad(x, (0, 0, 0, pad)) if pad else x)
    y = scaled_mm_quantized(xq, xs, weight, scale_inv, x.dtype)
    y = y[:m] if pad else y
    return y + bias if bias is not None else y


def gemm_triton(x, weight, scale_inv, bias=None):
    from dflash.model.fp8_triton import block_fp8_matmul
    from dflash.model.fp8_triton import quantize_activation as quantize_on_gpu

    xq, xs = quantize_on_gpu(x)
    y = block_fp8_matmul(xq, xs, weight, scale_inv, x.dtype)
    return y + bias if bias is not None else y


_GEMM_FNS = {"scaled_mm": gemm_scaled_mm, "triton": gemm_triton, "dequant": gemm_dequant}


def fp8_capable(device) -> bool:
    """Whether `device` has FP8 tensor cores (CUDA compute capability 8.9 or newer)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def pick_gemm(device) -> str:
    """The GEMM for `device`: scaled_mm on SM 9.0 (cuBLASLt's block-scaled kernels), triton on other FP8
    GPUs (SM 8.9, 10.x, 12.0), dequant elsewhere (CPU, older GPUs)."""
    device = torch.device(device)
    if not fp8_capable(device):
        return "dequant"
    return "scaled_mm" if torch.cuda.get_device_capability(device)[0] == 9 else "triton"


class Fp8Linear(torch.nn.Module):
    """A frozen linear layer holding a block-quantised weight: `weight` [N, K] fp8, `weight_scale_inv`
    [ceil(N/128), ceil(K/128)] fp32 (buffers: nothing here trains). `gemm` names the GEMM (GEMMS); a
    weight the chosen GEMM cannot take (scaled_mm's shape rule) runs on triton instead."""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
                 gemm: str = "dequant"):
        super().__init__()
        if weight.dtype != FP8:
            raise ValueError(f"Fp8Linear holds a float8_e4m3fn weight, got {weight.dtype}")
        n, k = weight.shape
        want = (math.ceil(n / BLOCK), math.ceil(k / BLOCK))
        if tuple(scale_inv.shape) != want:
            raise ValueError(f"a [{n}, {k}] weight has {want[0]} x {want[1]} blocks of 128, its scales are "
                             f"{tuple(scale_inv.shape)}")
        self.out_features, self.in_features = n, k
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale_inv", scale_inv.float())
        self.register_buffer("bias", bias)
        self.gemm = gemm

    @property
    def gemm(self) -> str:
        return self._gemm

    @gemm.setter
    def gemm(self, name: str) -> None:
        if name not in GEMMS:
            raise ValueError(f"unknown FP8 GEMM {name!r}; choose one of {', '.join(GEMMS)}")
        if name == "scaled_mm" and not scaled_mm_fits(self.out_features, self.in_features):
            name = "triton"
        self._gemm = name

    @classmethod
    def from_float(cls, linear: torch.nn.Linear, gemm: str = "dequant") -> "Fp8Linear":
        q, s = quantize_weight(linear.weight.detach())
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls(q, s, bias, gemm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., K] -> [..., N] in x's dtype."""
        lead = x.shape[:-1]
        y = _GEMM_FNS[self._gemm](x.reshape(-1, self.in_features), self.weight, self.weight_scale_inv, self.bias)
        return y.view(*lead, self.out_features)

    def takes_quantized(self, m: int) -> bool:
        """Whether forward_quantized runs an [m, K] input: a quantising GEMM (scaled_mm needs m % 16 == 0)."""
        return self._gemm == "triton" or (self._gemm == "scaled_mm" and m % 16 == 0)

    def forward_quantized(self, xq: torch.Tensor, xs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The GEMM of an input already quantised as dflash.model.fp8_triton quantises it: xq [M, K] fp8, xs
        [M, ceil(K/128)] (takes_quantized(M) must hold) -> [M, N] in `out_dtype`."""
        if self._gemm == "scaled_mm":
            return scaled_mm_quantized(xq, xs, self.weight, self.weight_scale_inv, out_dtype, self.bias)
        from dflash.model.fp8_triton import block_fp8_matmul

        y = block_fp8_matmul(xq, xs, self.weight, self.weight_scale_inv, out_dtype)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, gemm={self._gemm}"


# --------------------------------------------------------------------------------------------------
# A model's FP8 layers
# --------------------------------------------------------------------------------------------------
def _is_fp8_module(module) -> bool:
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and w.dtype == FP8 and hasattr(module, "weight_scale_inv")


def use_fp8_gemm(model: torch.nn.Module, gemm: str) -> int:
    """Run every FP8 linear layer of `model` (transformers' FP8Linear as loaded, or ours) on `gemm`: the
    FP8Linear modules are replaced by Fp8Linear holding the same tensors. Returns how many layers."""
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, Fp8Linear):
            module.gemm = gemm
            count += 1
        elif _is_fp8_module(module) and module.weight.dim() == 2:
            block = getattr(module, "block_size", None)
            if block is not None and tuple(block) != (BLOCK, BLOCK):
                raise ValueError(f"{name}: weight blocks {tuple(block)}; only 128 x 128 blocks are supported")
            model.set_submodule(name, Fp8Linear(module.weight.data, module.weight_scale_inv.data,
                                                getattr(module, "bias", None), gemm))
            count += 1
    return count


def quantize_model(model: torch.nn.Module, skip, gemm: str = "dequant") -> int:
    """Replace, in memory, every nn.Linear of `model` that `skip` (modules_to_not_convert, matched as
    transformers matches it) leaves in, by an Fp8Linear of its weight. Returns how many layers."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    count = 0
    for name, module in list(model.named_modules()):
        if type(module) is torch.nn.Linear and should_convert_module(name, list(skip)):
            model.set_submodule(name, Fp8Linear.from_float(module, gemm))
            count += 1
    return count


def fp8_layers(model: torch.nn.Module) -> list[Fp8Linear]:
    return [m for m in model.modules() if isinstance(m, Fp8Linear)]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of `model`'s parameters and buffers as they sit in memory (FP8 weights 1 byte, scales 4)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())
