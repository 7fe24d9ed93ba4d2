"""One decoder pass that keeps chosen layers' outputs, and may end after the last layer it needs.

Training reads only the tapped layers' outputs (Qwen3.5-27B: layers 1, 16, 31, 46 and 61 of 64), so the
layers after the last tap, and the final norm, would compute states nothing reads: 2 of 64 layers at
the 27B shape. A forward hook on that layer raises once its output is kept, and the pass ends there.
Only a pass without a cache may end early: a cached pass must update every layer's cache.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class _LastLayerTaken(Exception):
    """Raised by the hook of the last layer a pass needs, to end the pass there."""


def tapped_pass(decoder: torch.nn.Module, layers, taps: Iterable[int], stop_after: int | None = None,
                **inputs) -> tuple[object | None, dict[int, torch.Tensor]]:
    """`decoder(**inputs)` keeping the output of each `layers[i]` for i in `taps` (and `stop_after`):
    (the decoder's output, {i: [B,T,H]}). With `stop_after`, the pass ends right after that layer and the
    decoder's output is None."""
    captured: dict[int, torch.Tensor] = {}

    def keep(layer_id: int):
        def hook(_module, _inputs, output):
            captured[layer_id] = output[0] if isinstance(output, tuple) else output
            if layer_id == stop_after:
                raise _LastLayerTaken
        return hook

    wanted = sorted(set(taps) | ({stop_after} if stop_after is not None else set()))
    handles = [layers[i].register_forward_hook(keep(i)) for i in wanted]
    try:
        return decoder(**inputs), captured
    except _LastLayerTaken:
        return None, captured
    finally:
        for handle in handles:
            handle.remove()
