"""The training step's gradients against an fp32 reference step (bench/bench_drafter.py's numerics).

On a CPU the step runs in fp32 end to end, so every variant must match the reference to fp32 rounding;
on a GPU (bf16 autocast, compiled layers, flex attention, the fused head) the gradients must keep cosine
>= 0.999 with the fp32 reference (no TF32) in every parameter group, at a small drafter shape.
"""

import pytest
import torch

from bench.bench_drafter import (SHAPES, StandInTarget, VARIANTS, compare, drafter_config, gradients, make_batch,
                                 new_drafter, one_step, reference_gradients)


def _setup(shape: dict, device: torch.device, dtype: torch.dtype):
    dcfg = drafter_config(shape, 2, 8)
    target = StandInTarget(shape, device, dtype, len(dcfg.target_layer_ids))
    batch, anchors = make_batch(shape, device)
    state = {k: v.clone() for k, v in new_drafter(dcfg, device, "sdpa", False).state_dict().items()}
    return dcfg, target, batch, anchors, state


@pytest.mark.parametrize("variant", ["before", "fused-head"])
def test_fp32_step_matches_the_reference_on_the_cpu(variant):
    shape = dict(SHAPES["tiny"], seq=96, anchors=6)
    device = torch.device("cpu")
    dcfg, target, batch, anchors, state = _setup(shape, device, torch.float32)
    ref = reference_gradients(dcfg, shape, target, batch, anchors, device, state)
    drafter = new_drafter(dcfg, device, "sdpa", False, state)
    one_step(drafter, target, batch, anchors, dcfg, torch.float32, VARIANTS[variant]["fused_head"], device)
    for group, r in compare(gradients(drafter), ref).items():
        assert r["cosine"] > 1 - 1e-9 and r["rel_l2"] < 1e-5, (group, r)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["before", "after"])
def test_bf16_step_keeps_its_gradients_next_to_the_fp32_reference_on_the_gpu(variant):
    shape = dict(SHAPES["small"], seq=1024, anchors=64)
    device = torch.device("cuda")
    dcfg, target, batch, anchors, state = _setup(shape, device, torch.bfloat16)
    ref = reference_gradients(dcfg, shape, target, batch, anchors, device, state)
    v = VARIANTS[variant]
    drafter = new_drafter(dcfg, device, "flex", v["compiled"], state)
    one_step(drafter, target, batch, anchors, dcfg, torch.bfloat16, v["fused_head"], device)
    result = compare(gradients(drafter), ref)
    for group, r in result.items():
        assert r["cosine"] >= 0.999, (group, r)
