"""Compiled drafter layers meet the shapes a run gives them: packed rows compile once and never again; padded
batches of two shapes compile each statically (a dynamic-shape recompile of the layer's backward is what
crashed on a GPU at the second shape). On a CPU inductor compiles the sdpa layer; the GPU test runs flex."""

from __future__ import annotations

import pytest
import torch

from dflash.cli import train_config
from dflash.train.trainer import train
from tests.support.dflash_train_fixtures import train_args


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _run(tiny_chat, out, device: str, **batching) -> tuple[list[int], list[tuple[int, ...]]]:
    """(graphs compiled so far after each step, the token count of each step) of a 3-step compiled run."""
    target, data = tiny_chat
    graphs, tokens = [], []

    def on_step(step, m):
        graphs.append(_graphs())
        tokens.append(m["tokens"])
        return False

    config = train_config(train_args(target, data, out, max_steps=3, compile="on", device=device,
                                     drafter_layers=2, **batching))
    assert train(config, handle_signals=False, on_step=on_step).step == 3
    return graphs, tokens


def _check(tiny_chat, tmp_path, device):
    torch._dynamo.reset()
    # 32 anchors x block 4: 128 drafter query rows, the fewest compiled flex takes (dflash.train.setup)
    graphs, tokens = _run(tiny_chat, tmp_path / "packed", device, packing="on", pack_tokens=256, pack_anchors=32)
    assert graphs[0] > 0 and graphs[1:] == [graphs[0]] * 2, f"packed rows recompiled: {graphs}"
    torch._dynamo.reset()
    graphs, tokens = _run(tiny_chat, tmp_path / "padded", device, packing="off", batch_size=2, max_tokens=400, max_length=200)
    assert len(set(tokens)) > 1, "the padded run should meet more than one batch shape"


@pytest.mark.slow  # inductor compiles the layer's forward and backward on the CPU: about 3 minutes
def test_packed_rows_compile_once_and_padded_shapes_compile_without_a_crash_on_the_cpu(tiny_chat, tmp_path):
    _check(tiny_chat, tmp_path, "cpu")


@pytest.mark.gpu
def test_the_same_on_the_gpu_with_flex_attention(tiny_chat, tmp_path):
    _check(tiny_chat, tmp_path, "cuda")
