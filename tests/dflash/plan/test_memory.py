"""The memory model's exact terms against real modules and real AdamW state on the CPU, and its
structure (what each layout moves off a rank)."""

from __future__ import annotations

import pytest
import torch

from dflash.model.drafter import Drafter
from dflash.model.target import Target
from dflash.plan.memory import GB, MicroBatch, activation_terms, rank_peaks
from dflash.plan.sizes import drafter_shape, preset_shape, target_shape, target_shape_from_dir
from dflash.train.step import backward, micro_batch_sums
from dflash.train.probes.synthetic import collate_with_anchors, synthetic_items
from dflash import distributed
from tests.support.dflash_train_fixtures import save_chat_target


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_chat_target(tmp_path_factory.mktemp("plan") / "target", num_layers=8)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_target_and_drafter_parameters_are_the_real_modules(tiny_dir):
    shape = target_shape_from_dir(tiny_dir)
    target = Target.load(tiny_dir, dtype=torch.bfloat16)
    assert shape.params == sum(p.numel() for p in target.model.parameters())
    assert shape.layers == target.num_layers and shape.vocab == target.vocab_size
    assert shape.embed_params == target.model.get_input_embeddings().weight.numel()
    d = drafter_shape(shape, layers=2, block_size=4)
    real = Drafter(d.config)
    assert d.params == sum(p.numel() for p in real.parameters())
    assert d.tapped == len(target.layer_ids) == 5  # as Target taps an 8-layer model
    peak = rank_peaks(shape, d, MicroBatch(1, 64, 4), "replicate", precision="bf16")[0]
    # the target's weights in bf16, exactly what the loaded model holds
    assert peak.terms["target_weights"] * GB == _bytes(target.model.parameters())


def test_drafter_weights_gradients_and_adamw_state_are_exact(tiny_dir):
    """One real training step on the CPU: fp32 weights, gradients, AdamW's exp_avg and exp_avg_sq are
    4P, 4P and 8P bytes, as the model says."""
    shape = target_shape_from_dir(tiny_dir)
    target = Target.load(tiny_dir, dtype=torch.float32)
    d = drafter_shape(shape, layers=2, block_size=4)
    drafter = Drafter(d.config)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    items = synthetic_items(2, 64, target.vocab_size)
    batch, anchors = collate_with_anchors(items, 4, torch.device("cpu"))
    sums = micro_batch_sums(drafter, target, batch, anchors, block_size=4, gamma=None,
                            autocast_dtype=torch.float32)
    backward(sums, distributed.Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")), grad_accum=1)
    grads = _bytes(p.grad for p in drafter.parameters())
    opt.step()
    state = _bytes(s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    model = rank_peaks(shape, d, MicroBatch(2, 64, 4), "replicate", precision="fp32")[0]
    assert model.terms["drafter_weights"] * GB == _bytes(drafter.parameters()) == 4 * d.params
    assert model.terms["optimizer_state"] * GB == state == 8 * d.params
    assert grads == 4 * d.params
    sharded = rank_peaks(shape, d, MicroBatch(2, 64, 4), "shard", world=4, precision="fp32")[0]
    assert sharded.terms["optimizer_state"] * GB == pytest.approx(state / 4)


def test_27b_shape_matches_the_measured_facts():
    """The 27B preset: 53.79 GB of bf16 weights and a 1.835 B-parameter drafter (docs/performance.md)."""
    t = preset_shape("27b")
    d = drafter_shape(t)
    assert t.params * 2 / GB == pytest.approx(53.792, abs=0.001)
    assert d.params == 1_835_072_000 and d.tapped == 5
    assert preset_shape("27b", layers=8).layers == 8
    assert target_shape("demo").hidden == 64


def test_the_measured_h200_peaks_are_predicted_within_two_percent():
    """bench/results/h200: allocated peaks of the 27B-shape step (replicate, one H200) that the
    coefficients were not fitted on."""
    t, measured = preset_shape("27b"), {(1, 4096, 512, 5): 92.02, (2, 4096, 256, 5): 92.88,
                                        (2, 2048, 512, 5): 101.51, (1, 8192, 512, 3): 79.71,
                                        (2, 4096, 1024, 5): 121.75, (2, 16384, 1024, 5): 127.50}
    for (B, T, N, L), gb in measured.items():
        peak = rank_peaks(t, drafter_shape(t, layers=L), MicroBatch(B, T, N), "replicate")[0]
        allocated = peak.total_gb - peak.terms["cuda_context"] - peak.terms["allocator"]
        assert allocated == pytest.approx(gb, rel=0.02), (B, T, N, L)


def test_layouts_move_state_off_the_rank():
    t = preset_shape("27b")
    d = drafter_shape(t)
    mb = MicroBatch(2, 4096, 512)
    rep1 = rank_peaks(t, d, mb, "replicate", 1)[0]
    rep8 = rank_peaks(t, d, mb, "replicate", 8)[0]
    shard8 = rank_peaks(t, d, mb, "shard", 8)[0]
    off1 = rank_peaks(t, d, mb, "offload", 1)[0]
    assert rep8.total_gb > rep1.total_gb  # DDP's buckets: a second copy of the gradients
    assert shard8.terms["optimizer_state"] == pytest.approx(rep1.terms["optimizer_state"] / 8)
    assert "optimizer_state" not in off1.terms and off1.host_gb == pytest.approx(16 * d.params / GB)
    pipe = rank_peaks(t, d, mb, "pipeline", 8, target_stages=4)
    stages = [r for r in pipe if r.role.startswith("target stage")]
    assert all(r.terms["target_weights"] < 16 for r in stages)
    drafter_rank = pipe[-1]
    assert drafter_rank.terms["target_weights"] == pytest.approx(2 * (t.embed_params + t.head_params) / GB)
    fp32 = activation_terms(t, d, mb, "fp32")["drafter_activations"]
    assert fp32 == pytest.approx(2 * activation_terms(t, d, mb, "bf16")["drafter_activations"])
