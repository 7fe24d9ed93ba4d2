"""The demo's CPU kernels held to one code path on every x86-64 CPU, so it prints the same tau anywhere.

The demo is a chain of float computations whose outcome is discrete: pre-training the tiny target,
its greedy answers (the training data), the drafter's training, greedy decoding. A last-bit difference
anywhere flips some argmax a few hundred steps later, and the drafter and its tau differ. Left alone,
three libraries choose their kernels by the CPU they run on:

    ATen (torch's own ops)   AVX-512, AVX2 or baseline kernels: another vector width adds a reduction's
                             partial sums in another order; the vectorised exp/log differ in the last bit
    MKL (matmuls)            per-ISA and per-vendor GEMM kernels (Intel's AVX-512 path, AMD's AVX2 path)
    oneDNN (convolutions)    per-ISA JIT kernels (the GatedDeltaNet's causal conv1d on a CPU)

`hold()` pins each to a path every x86-64 CPU runs the same way: ATen's baseline kernels
(ATEN_CPU_CAPABILITY=default), MKL's conditional numerical reproducibility in its COMPATIBLE branch
(MKL_CBWR), and no oneDNN (torch's native convolution, im2col + the MKL GEMM above). The thread count
is pinned separately (the demo's --cpu-threads 1). Both environment variables are read when the first
kernel runs, so `hold()` must run before any tensor op; it checks that ATen took its setting. The
price: the demo's CPU run is slower (docs/performance.md, The demo). On a GPU only the CPU side is
held; the GPU's own kernels are not bit-for-bit repeatable.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

# read by ATen and MKL when their first kernel runs, never again
HELD_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}


def hold() -> bool:
    """Pin ATen, MKL and oneDNN to their portable paths for the rest of this process (module docstring).

    In a process where a tensor op already ran (a notebook, a test run calling the demo in-process) ATen
    has fixed its path: nothing is changed then, a warning says the tau will not be the portable one, and
    the result is False (the demo target's cache key then says 'native')."""
    seen = {k: os.environ.get(k) for k in HELD_ENV}
    os.environ["ATEN_CPU_CAPABILITY"] = HELD_ENV["ATEN_CPU_CAPABILITY"]
    capability = torch.backends.cpu.get_cpu_capability()  # fixes ATen's path, unless an op already did
    if capability != "DEFAULT":
        if seen["ATEN_CPU_CAPABILITY"] is None:
            del os.environ["ATEN_CPU_CAPABILITY"]
        else:
            os.environ["ATEN_CPU_CAPABILITY"] = seen["ATEN_CPU_CAPABILITY"]
        log.warning("the demo's CPU kernels could not be held to one path on every CPU: a tensor op ran earlier in "
                    "this process and fixed ATen's at %s, so the drafter and tau follow this CPU. Start the demo in "
                    "a process of its own (dflash-train with no --target/--data) for the portable figure.", capability)
        return False
    replaced = {k: v for k, v in seen.items() if v is not None and v.upper() != HELD_ENV[k].upper()}
    if replaced:
        log.warning("the demo holds its CPU kernels to one path on every CPU: %s replaced by %s",
                    ", ".join(f"{k}={v}" for k, v in replaced.items()),
                    ", ".join(f"{k}={HELD_ENV[k]}" for k in replaced))
    os.environ.update(HELD_ENV)  # MKL reads MKL_CBWR at its first call
    torch.backends.mkldnn.enabled = False
    return True


def kernels() -> str:
    """'portable' when this process runs the held paths (`hold()` ran first), else 'native': a demo target
    built one way is another target than one built the other way, so its cache key names which."""
    portable = (torch.backends.cpu.get_cpu_capability() == "DEFAULT" and not torch.backends.mkldnn.enabled
                and os.environ.get("MKL_CBWR", "").upper() == HELD_ENV["MKL_CBWR"])
    return "portable" if portable else "native"
