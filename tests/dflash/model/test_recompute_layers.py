"""Drafter.recompute_layers: layers that recompute their activations in the backward give the same loss and the
same gradients as layers that keep them, for both drafter kinds, and keep less for the backward."""

import pytest
import torch

from dflash.kinds.dflash2.dflash2_drafter import DFlash2Config, DFlash2Drafter
from dflash.model.drafter import Drafter, DrafterConfig

SHAPE = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             intermediate_size=48, vocab_size=96, block_size=4, num_target_layers=6, target_layer_ids=[1, 3],
             mask_token_id=3)


def build(kind: str, recompute: int):
    torch.manual_seed(0)
    if kind == "dflash2":
        drafter = DFlash2Drafter(DFlash2Config(**SHAPE, conv_group_size=8, selector_rank=6, selector_top_k=5))
        with torch.no_grad():  # off the identity start, so the convolutions' gradients are not trivial
            for p in drafter.parameters():
                p.add_(0.05 * torch.randn_like(p))
    else:
        drafter = Drafter(DrafterConfig(**SHAPE))
    drafter.recompute_layers = recompute
    return drafter


def inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2, 11, 2 * 32, generator=g), torch.randn(2, 3 * 4, 32, generator=g),
            torch.tensor([[1, 4, 7], [0, 5, 6]]))


def saved_bytes(fn) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_recomputed_layers_give_the_same_loss_and_gradients(kind):
    grads, kept = {}, {}
    for recompute in (0, 2, 3):
        drafter = build(kind, recompute)
        out, kept[recompute] = saved_bytes(lambda: drafter(*inputs()))
        loss = (out.float() ** 2).mean()
        loss.backward()
        grads[recompute] = (loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()
                                            if p.grad is not None})
    for recompute in (2, 3):
        assert torch.equal(grads[recompute][0], grads[0][0])
        assert grads[recompute][1].keys() == grads[0][1].keys()
        for name, g in grads[0][1].items():
            torch.testing.assert_close(grads[recompute][1][name], g, rtol=0, atol=0, msg=name)
    assert kept[3] < kept[2] < kept[0]


def test_no_recompute_without_gradients():
    drafter = build("dflash", 3)
    with torch.no_grad():
        out = drafter(*inputs())
    assert not out.requires_grad


def test_more_recomputed_layers_than_the_drafter_has_are_refused_by_name():
    from dflash.config import TrainConfig
    from dflash.errors import ConfigError

    assert TrainConfig.from_flat(drafter_layers=3, recompute_layers=3).runtime.recompute_layers == 3
    with pytest.raises(ConfigError, match="--recompute-layers 4 is more than the drafter's 3 layers"):
        TrainConfig.from_flat(drafter_layers=3, recompute_layers=4)
    with pytest.raises(ConfigError, match="recompute"):
        TrainConfig.from_flat(recompute_layers=-1)


def test_the_memory_model_counts_a_recomputed_layer_as_its_input():
    """27B shape, one packed row of 8,192 tokens with 1,024 anchors: each recomputed layer keeps 2 bytes per
    block row x H instead of c_layer (+ the kind's surplus); with every layer recomputed one layer's
    activations still exist while it runs again."""
    from dflash.plan.memory import COEFFS, MicroBatch, activation_terms
    from dflash.plan.sizes import drafter_shape, target_shape

    target = target_shape("27b")
    mb = MicroBatch(1, 8192, 1024)
    rows_h = 1024 * 16 * target.hidden / 1e9
    for kind in ("dflash", "dflash2"):
        act = {r: activation_terms(target, drafter_shape(target, kind=kind, recompute=r), mb, "bf16")
               ["drafter_activations"] for r in (0, 2, 5)}
        per_layer = (COEFFS["layer"] + drafter_shape(target, kind=kind).layer_surplus) * rows_h
        assert act[0] - act[2] == pytest.approx(2 * (per_layer - COEFFS["input"] * rows_h))
        assert act[0] - act[5] == pytest.approx(4 * per_layer - 5 * COEFFS["input"] * rows_h)


def test_the_throughput_model_counts_the_recomputed_forwards():
    """Each recomputed layer adds its share of the drafter's forward to the backward (the head is not rerun)."""
    from dflash.plan.memory import MicroBatch
    from dflash.plan.sizes import drafter_shape, target_shape
    from dflash.plan.throughput import CARDS, phase_times

    target, mb = target_shape("27b"), MicroBatch(1, 8192, 1024)
    t = {r: phase_times(target, drafter_shape(target, recompute=r), mb, CARDS["h200"]) for r in (0, 2, 5)}
    extra = {r: t[r]["drafter backward"] - t[0]["drafter backward"] for r in (2, 5)}
    assert 0 < extra[2] < extra[5] < t[0]["drafter forward"]
    assert extra[5] == pytest.approx(2.5 * extra[2])
    assert all(t[r]["drafter forward"] == t[0]["drafter forward"] for r in (2, 5))
