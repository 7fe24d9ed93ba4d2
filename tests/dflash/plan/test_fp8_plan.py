"""The memory model knows FP8 targets: 1 byte per quantised weight + float32 block scales + the rest in bf16."""

from __future__ import annotations

import math

from dflash.plan.memory import MicroBatch, rank_peaks
from dflash.plan.planner import card_from_args, fewest_stages
from dflash.plan.sizes import drafter_shape, target_shape
from tests.support.dflash_tiny import save_tiny_target


def test_fp8_27b_weight_bytes_from_its_parts():
    bf16, fp8 = target_shape("27b", precision="bf16"), target_shape("27b", precision="fp8")
    assert not bf16.fp8 and fp8.fp8 and bf16.params == fp8.params
    q, s = sum(fp8.fp8_layer_params), sum(fp8.fp8_layer_scales)
    assert fp8.weight_bytes(2) == (fp8.params - q) * 2 + q + 4 * s
    assert abs(bf16.weight_bytes(2) / 1e9 - 53.8) < 0.1
    assert 29.0 < fp8.weight_bytes(2) / 1e9 < 30.0   # embedding + LM head (5.1 GB) stay bf16
    # a GatedDeltaNet layer keeps in_proj_a / in_proj_b (48 x 5120 each), its convolution and norms in bf16:
    # under 1 % of the layer; a full-attention layer only its norms
    kept = [n - q for n, q in zip(bf16.layer_params, fp8.fp8_layer_params)]
    assert 2 * 48 * 5120 <= kept[0] < bf16.layer_params[0] / 100 and kept[3] < 2 * 5120 + 2 * 256 + 1


def test_memory_check_reads_an_fp8_directory(tmp_path):
    from dflash.model.fp8_checkpoint import write_fp8_checkpoint

    src = save_tiny_target(tmp_path / "bf16")
    write_fp8_checkpoint(src, tmp_path / "fp8")
    auto = target_shape(str(tmp_path / "fp8"))
    assert auto.fp8 and not target_shape(str(src)).fp8
    assert target_shape(str(src), precision="fp8").fp8_layer_params == auto.fp8_layer_params
    scales = sum(auto.fp8_layer_scales)
    assert scales == 50  # each of the tiny target's 50 FP8 linears is one partial 128 x 128 block
    drafter = drafter_shape(auto, layers=1, block_size=4)
    peak = rank_peaks(auto, drafter, MicroBatch(1, 64, 4), "replicate")[0]
    assert math.isclose(peak.terms["target_weights"], auto.weight_bytes(2) / 1e9, rel_tol=1e-3)


def test_fp8_needs_fewer_pipeline_stages_on_eight_32gb_cards():
    card = card_from_args("rtx-5090", None)
    mb = MicroBatch(1, 4096, 512)
    counts = {}
    for precision in ("bf16", "fp8"):
        target = target_shape("27b", precision=precision)
        counts[precision] = fewest_stages(target, drafter_shape(target), mb, card, 8)
    assert counts["fp8"] is not None and counts["bf16"] is not None and counts["fp8"] < counts["bf16"]
