"""Timing on a device: clock reads that wait for the GPU, medians of repeated calls, a measured matmul peak.

The benchmarks under bench/ and dflash.train.probes.step_numerics time the trainer's code with these:

    sync(device)                      wait for the device's queued kernels (a no-op on a CPU)
    free_memory(device)               collect garbage and return cached CUDA blocks before the next variant
    timed(fn, device, reps, warmup)   median milliseconds of fn(): CUDA events on a GPU, perf_counter on a CPU
    matmul_peak(device)               bf16 TFLOP/s of [n, n] @ [n, n] products on random data: the peak a
                                      model-FLOPs share (MFU) is measured against in the same run
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    """Wait until `device` has run everything queued on it (CUDA only; a CPU runs synchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Drop what the last variant left behind before the next one allocates (a 27B target leaves little)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of fn() over `reps` calls after `warmup` untimed ones (CUDA events on a GPU,
    perf_counter on a CPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def matmul_peak(device: torch.device, n: int = 8192, reps: int = 10) -> float:
    """bf16 TFLOP/s of [n, n] @ [n, n] products on random data (median of `reps` after 3 warm-ups)."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    return 2 * n ** 3 / (timed(lambda: a @ b, device, reps, warmup=3) / 1e3) / 1e12
