"""The smallest proof that Triton can JIT here: compile one kernel, launch it, check its output.

Triton builds a C launcher with the host's C compiler on first use and caches compiled kernels under
~/.triton (TRITON_CACHE_DIR); a read-only home or a missing compiler breaks every fla kernel, which is
why the doctor runs this for real instead of trusting `import triton`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _axpb_kernel(x_ptr, y_ptr, n, a, b, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(y_ptr + offs, x * a + b, mask=mask)


def jit_smoke(device) -> float:
    """y = 3x + 1 on 1000 floats via a freshly JIT-compiled kernel; returns the max abs error (0 expected).
    y starts as NaN, so a kernel that does not run cannot pass."""
    x = torch.arange(1000, dtype=torch.float32, device=device)
    y = torch.full_like(x, float("nan"))
    _axpb_kernel[(triton.cdiv(x.numel(), 256),)](x, y, x.numel(), 3.0, 1.0, BLOCK=256)
    torch.cuda.synchronize(device)
    err = (y - (3 * x + 1)).abs().max()
    return float("nan") if not torch.isfinite(y).all() else err.item()
