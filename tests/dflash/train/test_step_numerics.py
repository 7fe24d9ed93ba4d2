"""The training step's gradients against an fp32 reference step (dflash.train.probes.step_numerics; bench/bench_drafter.py
runs the same comparison at the 27B shape).

On a CPU the step runs in fp32 end to end, so every variant must match the reference to fp32 rounding;
on a GPU (bf16 autocast, compiled layers, flex attention, the fused head) the gradients must keep cosine
>= 0.999 with the fp32 reference (no TF32) in every parameter group, at a small drafter shape.
"""

import pytest
import torch

from dflash.train.probes.step_numerics import (STEP_VARIANTS, StandInTarget, compare, gradients, new_drafter, one_step,
                                   reference_gradients)
from dflash.model.shapes import STEP_SHAPES, drafter_config
from dflash.train.probes.synthetic import synthetic_batch


def _gradients_vs_reference(shape: dict, device: torch.device, variant: str) -> dict:
    """One micro-batch of `variant` (fp32 and SDPA on a CPU; bf16 autocast and flex on a GPU) against the
    fp32 reference step on the same weights and inputs: compare()'s cosine / relative L2 per group."""
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    dcfg = drafter_config(shape, 2, 8)
    target = StandInTarget(shape, device, dtype, len(dcfg.target_layer_ids))
    batch, anchors = synthetic_batch(shape, device)
    state = {k: v.clone() for k, v in new_drafter(dcfg, device, "sdpa", False).state_dict().items()}
    ref = reference_gradients(dcfg, shape, target, batch, anchors, device, state)
    v = STEP_VARIANTS[variant]
    drafter = new_drafter(dcfg, device, "flex" if gpu else "sdpa", v["compiled"], state)
    one_step(drafter, target, batch, anchors, dcfg, dtype, v["fused_head"], device)
    return compare(gradients(drafter), ref)


@pytest.mark.parametrize("variant", ["before", "fused-head"])
def test_fp32_step_matches_the_reference_on_the_cpu(variant):
    result = _gradients_vs_reference(dict(STEP_SHAPES["tiny"], seq=96, anchors=6), torch.device("cpu"), variant)
    for group, r in result.items():
        assert r["cosine"] > 1 - 1e-9 and r["rel_l2"] < 1e-5, (group, r)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["before", "after"])
def test_bf16_step_keeps_its_gradients_next_to_the_fp32_reference_on_the_gpu(variant):
    result = _gradients_vs_reference(dict(STEP_SHAPES["small"], seq=1024, anchors=64), torch.device("cuda"), variant)
    for group, r in result.items():
        assert r["cosine"] >= 0.999, (group, r)
