"""Triton kernels for block-quantised FP8: the GEMM y [M, N] = (xq * a_s) [M, K] @ (W * w_s)^T with fp32
accumulation, and the activation quantisation that feeds it and torch's scaled_mm.

    quantize_activation(x)    [M, K] bf16/fp16/fp32 -> (xq [M, K] fp8, a_s [M, ceil(K/128)] fp32): one read of x,
                              one write of xq; a_s is column-major (scaled_mm's layout for 1x128 scales)
    block_fp8_matmul(...)     the GEMM below
    silu_mul_quantize(g, u)   quantize_activation(silu(g) * u) in one pass (dflash.model.fused_mlp)

    xq [M, K] fp8, a_s [M, ceil(K/128)] fp32     activations, one scale per token and 128 columns
    W  [N, K] fp8, w_s [ceil(N/128), ceil(K/128)] fp32   weights, one scale per 128 x 128 block

The quantisation does what dflash.model.fp8.quantize_activation does in eager torch (per token and 128
columns: scale = max |x| / 448, floored at 1e-12; xq = clamp(x / scale, +-448)), in one pass instead of the
eight or so kernels eager torch launches over an fp32 copy of x, which cost more than the FP8 GEMM saved.

The GEMM's K loop steps 128 columns at a time, so each step meets one activation scale per row and one weight
scale per output column (K / 128 steps, a compile-time count: one compile per K of the model; read per column: a tile narrower than 128 never straddles two weight blocks, and
partial edge blocks need no special case). Masked loads fill the edges with zeros.

It exists because on SM 12.0 (RTX 5090, RTX PRO 6000) torch 2.11 has no block-scaled FP8 recipe (its
1x128/128x128 path is SM 9.0 only) and transformers' own kernels (5.24, 5.25) are fetched from the Hub at run
time (`kernels-community/finegrained-fp8`, DeepGEMM), which an offline training host cannot do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

BLOCK_K = 128  # the scale granularity along K: one activation scale and one weight scale per K step
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
QUANT_ROWS = 32  # tokens per program of the quantisation kernel (x 128 columns)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_xk, stride_qm, stride_qk, stride_sm, stride_sk,
                     ROWS: tl.constexpr, GROUP: tl.constexpr, FMAX: tl.constexpr):
    offs_m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    kb = tl.program_id(1)
    offs_k = kb * GROUP + tl.arange(0, GROUP)
    inside = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=inside, other=0.0)
    x = x.to(tl.float32)
    # x / scale with IEEE division (div_rn), as torch divides two tensors: Triton's `/` on fp32 is an
    # approximate division whose last bit can differ, and a value near a rounding boundary then lands on the
    # neighbouring fp8 value. The scale's `/ FMAX` matches torch's division by a Python float as it is.
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) / FMAX, 1e-12)
    x, by = tl.broadcast(x, scale[:, None])
    q = tl.clamp(tl.math.div_rn(x, by), -FMAX, FMAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_k[None, :] * stride_qk, q, mask=inside)
    tl.store(s_ptr + offs_m * stride_sm + kb * stride_sk, scale, mask=offs_m < M)


def quantize_activation(x: torch.Tensor, rows: int = QUANT_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] activations -> (xq [M, K] float8_e4m3fn, scales [M, ceil(K/128)] fp32, column-major)."""
    m, k = x.shape
    kb = triton.cdiv(k, BLOCK_K)
    xq = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(kb, m, dtype=torch.float32, device=x.device).t()  # [M, kb], stride (1, M)
    _quantize_kernel[(triton.cdiv(m, rows), kb)](x, xq, scales, m, k, x.stride(0), x.stride(1), xq.stride(0),
                                                 xq.stride(1), scales.stride(0), scales.stride(1),
                                                 ROWS=rows, GROUP=BLOCK_K, FMAX=FP8_MAX)
    return xq, scales


@triton.jit
def _silu_mul_quantize_kernel(g_ptr, u_ptr, q_ptr, s_ptr, M, K, stride_gm, stride_gk, stride_um, stride_uk,
                              stride_qm, stride_qk, stride_sm, stride_sk,
                              ROWS: tl.constexpr, GROUP: tl.constexpr, FMAX: tl.constexpr):
    offs_m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    kb = tl.program_id(1)
    offs_k = kb * GROUP + tl.arange(0, GROUP)
    inside = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    g = tl.load(g_ptr + offs_m[:, None] * stride_gm + offs_k[None, :] * stride_gk, mask=inside, other=0.0)
    u = tl.load(u_ptr + offs_m[:, None] * stride_um + offs_k[None, :] * stride_uk, mask=inside, other=0.0)
    # eager torch's arithmetic and roundings: silu(g) = g / (1 + exp(-g)) in fp32 (IEEE exp and division, as
    # torch's CUDA kernel computes it), rounded to the activations' dtype; the product in fp32, rounded again
    dt = g_ptr.dtype.element_ty
    gf = g.to(tl.float32)
    a = tl.math.div_rn(gf, 1.0 + libdevice.exp(-gf)).to(dt)
    x = (a.to(tl.float32) * u.to(tl.float32)).to(dt).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) / FMAX, 1e-12)
    x, by = tl.broadcast(x, scale[:, None])
    q = tl.clamp(tl.math.div_rn(x, by), -FMAX, FMAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_k[None, :] * stride_qk, q, mask=inside)
    tl.store(s_ptr + offs_m * stride_sm + kb * stride_sk, scale, mask=offs_m < M)


def silu_mul_quantize(gate: torch.Tensor, up: torch.Tensor, rows: int = QUANT_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activation(silu(gate) * up) in one pass: [M, K] bf16/fp16 gate and up -> (xq [M, K] fp8, scales
    [M, ceil(K/128)] fp32, column-major), the same bytes as eager SiLU, product and quantisation."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match")
    m, k = gate.shape
    kb = triton.cdiv(k, BLOCK_K)
    xq = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=gate.device)
    scales = torch.empty(kb, m, dtype=torch.float32, device=gate.device).t()  # [M, kb], stride (1, M)
    _silu_mul_quantize_kernel[(triton.cdiv(m, rows), kb)](
        gate, up, xq, scales, m, k, gate.stride(0), gate.stride(1), up.stride(0), up.stride(1), xq.stride(0),
        xq.stride(1), scales.stride(0), scales.stride(1), ROWS=rows, GROUP=BLOCK_K, FMAX=FP8_MAX)
    return xq, scales


@triton.jit
def _block_fp8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, M, N, K,
                      stride_am, stride_ak, stride_asm, stride_ask, stride_wn, stride_wk, stride_wsn, stride_wsk,
                      stride_cm, stride_cn,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      NUM_KB: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    # grouped launch order: GROUP_M row tiles share the same weight tiles while they are in L2
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    in_m = offs_m < M
    in_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, NUM_KB):
        k = kb * BLOCK_K + offs_k
        in_k = k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=in_m[:, None] & in_k[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + k[:, None] * stride_wk,
                    mask=in_n[None, :] & in_k[:, None], other=0.0)
        a_s = tl.load(as_ptr + offs_m * stride_asm + kb * stride_ask, mask=in_m, other=0.0)
        w_s = tl.load(ws_ptr + (offs_n // BLOCK_K) * stride_wsn + kb * stride_wsk, mask=in_n, other=0.0)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, c,
             mask=in_m[:, None] & in_n[None, :])


def block_fp8_matmul(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                     out_dtype: torch.dtype = torch.bfloat16, block_m: int = 64, block_n: int = 128,
                     group_m: int = 8, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """[M, K] fp8 x [N, K] fp8 with their block scales -> [M, N] in `out_dtype`."""
    m, k = xq.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"activations [{m}, {k}] and weight {tuple(weight.shape)} disagree on K")
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _block_fp8_kernel[grid](xq, x_scale, weight, w_scale, out, m, n, k,
                            xq.stride(0), xq.stride(1), x_scale.stride(0), x_scale.stride(1),
                            weight.stride(0), weight.stride(1), w_scale.stride(0), w_scale.stride(1),
                            out.stride(0), out.stride(1),
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, GROUP_M=group_m, NUM_KB=triton.cdiv(k, BLOCK_K),
                            num_warps=num_warps, num_stages=num_stages)
    return out
