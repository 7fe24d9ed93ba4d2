"""The frozen target's RMSNorms compiled, each into one kernel (on a GPU).

transformers runs a Qwen3.5 RMSNorm eagerly: an fp32 copy of the input, pow, mean, rsqrt, two broadcast
products, the cast back (the gated norm adds an fp32 SiLU and a third product): about seven kernels over
fp32 tensors of the activations' size. At the 27B shape a training pass runs 201 of them on 8,192-token
rows (two per layer, the GatedDeltaNet's gated norm, the attention layers' q/k norms): ~150 ms of the
~610 ms FP8 target pass on an H100 (bench/NOTES.md). Compiled, each norm is one kernel that reads its
input once and writes bf16 once.

`compile_norms` compiles each norm module in place (`Module.compile()`: the module's own forward, so the
arithmetic is transformers' own; instances of one class share the compiled code, as the drafter's layers do,
dflash.model.drafter.Drafter.compile_layers). Default dynamic shapes: the packed rows' norms compile once per
input rank, padded batches once more when the length changes. The target runs under no_grad: inference
graphs only. On a CPU nothing is compiled (the compile would cost more than it saves on the small models
trained there).
"""

from __future__ import annotations

import torch

# The norm classes of the Qwen3.5 / Qwen3-Next hybrids and Qwen3 (transformers' class names end so).
NORM_SUFFIXES = ("RMSNorm", "RMSNormGated")


def norm_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The RMSNorm modules of `model` (its decoder's and attention's, the final norm), in module order."""
    return [m for m in model.modules() if type(m).__name__.endswith(NORM_SUFFIXES)]


def compile_norms(model: torch.nn.Module) -> int:
    """Compile every RMSNorm of `model` in place when its weights are on a GPU; the number compiled (0 on
    a CPU, and for a model whose norms already are)."""
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cuda":
        return 0
    done = 0
    for module in norm_modules(model):
        if getattr(module, "_compiled_call_impl", None) is None:
            module.compile()
            done += 1
    return done
