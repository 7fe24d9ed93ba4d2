"""dflash.train.probes.mfu: the trainer's model FLOPs (anchor positions, no mask built) equal the count from the
drafter's dense attention mask (dense_mask_flops); the peak is known for data-sheet GPUs and absent on a CPU."""

from __future__ import annotations

import pytest
import torch

from dflash.batching.anchors import sample_anchors
from dflash.train.blocks import build_blocks
from dflash.data.batches import collate
from dflash.model.flops import drafter_pairs
from dflash.train.probes.mfu import StepFlops, dense_mask_flops, peak_flops
from dflash.model.drafter import DrafterConfig
from dflash.model.target import Target
from tests.support.dflash_train_fixtures import save_chat_target


def test_step_flops_match_the_dense_mask_count(tmp_path):
    target = Target.load(save_chat_target(tmp_path / "target"))
    dcfg = DrafterConfig.from_target(target, num_hidden_layers=2, block_size=4)
    g = torch.Generator().manual_seed(0)
    items = []
    for n in (40, 56, 33):
        mask = torch.zeros(n, dtype=torch.long)
        mask[n // 3:] = 1
        items.append({"input_ids": torch.randint(0, target.vocab_size, (n,), generator=g), "loss_mask": mask})
    anchors = [sample_anchors(it["loss_mask"], 6, g) for it in items]
    batch = collate(items, pad_id=0)
    blocks = build_blocks(batch["input_ids"], batch["loss_mask"] * batch["attention_mask"], anchors, 4,
                          target.mask_token_id)
    exact = dense_mask_flops(target, dcfg, batch["input_ids"], batch["attention_mask"], blocks)
    counted = StepFlops(target, dcfg)(items, anchors)
    assert counted == pytest.approx(exact["total"], rel=1e-12)


def test_drafter_pairs_and_window():
    assert drafter_pairs([0, 10], block_size=4) == 4 * (0 + 10 + 2 * 4)
    assert drafter_pairs([0, 10], block_size=4, window=3) == 4 * (0 + 3 + 2 * 4)


def test_no_peak_on_a_cpu():
    assert peak_flops(torch.device("cpu")) is None


def test_an_fp8_target_counts_the_same_forward_flops_as_its_bf16_original(tmp_path):
    """An FP8 target keeps its linear weights as float8 buffers, not parameters: they still count (its
    MFU and the benchmarks' physical limit were otherwise taken on the norms and convolutions alone)."""
    from dflash.model.flops import target_forward_flops
    from dflash.model.fp8 import quantize_model

    target = Target.load(save_chat_target(tmp_path / "target"))
    before = target_forward_flops(target, [40, 56])
    assert quantize_model(target.model, []) > 0
    assert target_forward_flops(target, [40, 56]) == pytest.approx(before, rel=1e-12)
