"""The planner's choices on the cards users own (H200 141 GB, RTX PRO 6000 96 GB, RTX 5090 32 GB) x 1, 2
and 8 GPUs at the 27B shape and the standard micro-batch (2 x 4096, 512 anchors per sequence)."""

from __future__ import annotations

import pytest

from dflash.errors import ConfigError
from dflash.plan.memory import MicroBatch
from dflash.plan.planner import best_fitting, card_from_args, plan
from dflash.plan.sizes import drafter_shape, preset_shape
from dflash.plan.throughput import CARDS, STEP_LATENCY_S, collective_s, tokens_per_second

STANDARD = MicroBatch(2, 4096, 512)


@pytest.fixture(scope="module")
def shapes():
    t = preset_shape("27b")
    return t, drafter_shape(t)


# card, GPUs -> the best layout at the standard micro-batch (None: nothing fits it)
EXPECTED = {
    ("h200", 1): "replicate", ("h200", 2): "shard", ("h200", 8): "shard",
    ("rtx-pro-6000", 1): "offload", ("rtx-pro-6000", 2): "shard", ("rtx-pro-6000", 8): "shard",
    ("rtx-5090", 1): None, ("rtx-5090", 2): None, ("rtx-5090", 8): None,
}


@pytest.mark.parametrize("card, gpus", list(EXPECTED))
def test_best_layout_per_card_and_count(shapes, card, gpus):
    target, drafter = shapes
    options, best = plan(target, drafter, STANDARD, CARDS[card], gpus)
    assert (best.layout if best else None) == EXPECTED[(card, gpus)]
    for o in options:
        if o.fits:  # what fits is within the card, every rank of it
            assert all(r.total_gb <= CARDS[card].memory_gb for r in o.ranks)
    if best:
        assert best.tokens_per_s == max(o.tokens_per_s for o in options if o.fits)


def test_replicate_does_not_fit_a_96_gb_card_and_offload_does(shapes):
    """The issue's finding: 2 x 4096 at 512 anchors runs out of memory on a 96 GB card (102 GB usable) as
    today's layout, measured with the H200 capped at 102 GB."""
    target, drafter = shapes
    options = {o.layout: o for o in plan(target, drafter, STANDARD, CARDS["rtx-pro-6000"], 1)[0]}
    assert not options["replicate"].fits and options["offload"].fits
    assert "pipeline needs a rank for the drafter" in options["pipeline"].why_not
    # and what did fit under that cap: 256 anchors per sequence, or 1 sequence with 512
    for smaller in (MicroBatch(2, 4096, 256), MicroBatch(1, 4096, 512)):
        assert plan(target, drafter, smaller, CARDS["rtx-pro-6000"], 1, layouts=("replicate",))[1] is not None


def test_eight_32_gb_cards_fit_a_smaller_micro_batch_with_the_target_pipelined(shapes):
    target, drafter = shapes
    mb, best = best_fitting(target, drafter, STANDARD, CARDS["rtx-5090"], 8)
    assert best.layout == "pipeline" and mb.anchors < STANDARD.anchors
    assert best.peak_gb <= CARDS["rtx-5090"].memory_gb
    assert best_fitting(target, drafter, STANDARD, CARDS["rtx-5090"], 1) is None  # 53.8 GB of target alone


def test_throughput_reproduces_the_measured_h200_step(shapes):
    """At the shape the phases were measured on, one H200 predicts their sum: 8192 tokens / 1.394 s."""
    target, drafter = shapes
    speed = tokens_per_second(target, drafter, STANDARD, "replicate", 1, CARDS["h200"])
    assert speed["tokens_per_s"] == pytest.approx(8192 / 1.394, rel=1e-3)
    slower = tokens_per_second(target, drafter, STANDARD, "replicate", 1, CARDS["rtx-pro-6000"])
    assert slower["tokens_per_s"] == pytest.approx(speed["tokens_per_s"] * 504 / 989, rel=1e-3)
    offload = tokens_per_second(target, drafter, STANDARD, "offload", 1, CARDS["rtx-pro-6000"])
    assert offload["tokens_per_s"] < slower["tokens_per_s"]  # the CPU's AdamW step is not free


def test_a_ring_collective_costs_its_bytes_at_the_slowest_link_and_a_latency_per_step():
    """Within a node the card's link (H200 NVLink 450 GB/s); beyond 8 GPUs the network between nodes (50 GB/s)."""
    h200 = CARDS["h200"]
    assert collective_s("all-reduce", 8e9, 1, h200) == 0.0
    assert collective_s("all-reduce", 8e9, 8, h200) == pytest.approx(14 / 8 * 8e9 / 450e9 + 14 * STEP_LATENCY_S)
    assert collective_s("all-gather", 8e9, 16, h200, calls=3) == pytest.approx(15 / 16 * 8e9 / 50e9
                                                                               + 3 * 15 * STEP_LATENCY_S)


def test_card_arguments():
    assert card_from_args("H200", None).memory_gb == 150.1
    assert card_from_args(None, 48).memory_gb == 48
    assert card_from_args("rtx-5090", 30).memory_gb == 30
    with pytest.raises(ConfigError, match="unknown card; choose one of h200, rtx-pro-6000, rtx-5090"):
        card_from_args("a100", None)
    with pytest.raises(ConfigError, match="name the card"):
        card_from_args(None, None)
    with pytest.raises(ConfigError, match="positive"):
        card_from_args(None, 0)
