"""The learning-rate schedule, counted in optimizer steps (never micro-batches): linear warm-up, then
cosine decay to 0 (the DFlash recipe: warm-up 4 % of the steps)."""

from __future__ import annotations

import math
from collections.abc import Callable


def lr_lambda(total_steps: int, warmup_ratio: float) -> Callable[[int], float]:
    """Factor of the peak LR at optimizer step s: linear warm-up over ceil(ratio*total), then cosine to 0."""
    warmup = math.ceil(warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor
