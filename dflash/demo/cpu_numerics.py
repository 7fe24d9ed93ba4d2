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

from dflash.errors import ConfigError

log = logging.getLogger(__name__)

# read by ATen and MKL when their first kernel runs, never again
HELD_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}


def hold() -> None:
    """Pin ATen, MKL and oneDNN to their portable paths for the rest of this process (module docstring)."""
    seen = {k: os.environ.get(k) for k in HELD_ENV}
    overridden = {k: v for k, v in seen.items() if v is not None and v.lower() != HELD_ENV[k].lower()}
    if overridden:
        log.warning("the demo holds its CPU kernels to one path on every CPU: %s replaced by %s",
                    ", ".join(f"{k}={v}" for k, v in overridden.items()),
                    ", ".join(f"{k}={HELD_ENV[k]}" for k in overridden))
    os.environ.update(HELD_ENV)
    torch.backends.mkldnn.enabled = False
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "DEFAULT":
        raise ConfigError(f"the demo's CPU kernels could not be held to ATen's baseline path: a tensor op ran before "
                          f"dflash.demo.cpu_numerics.hold() and fixed it at {capability}. Start the demo in a new "
                          "process (dflash-train with no --target/--data), or set ATEN_CPU_CAPABILITY=default "
                          "and MKL_CBWR=COMPATIBLE before Python starts.")


def kernels() -> str:
    """'portable' when this process runs the held paths (`hold()` ran first), else 'native': a demo target
    built one way is another target than one built the other way, so its cache key names which."""
    portable = (torch.backends.cpu.get_cpu_capability() == "DEFAULT" and not torch.backends.mkldnn.enabled
                and os.environ.get("MKL_CBWR", "").upper() == HELD_ENV["MKL_CBWR"])
    return "portable" if portable else "native"
