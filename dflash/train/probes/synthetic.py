"""Synthetic training batches: random token sequences shaped like the trainer's, with anchors sampled the
trainer's way, for timing and checking the step without a data set.

    synthetic_items(n, T, V)                n items {input_ids [T] int64 in 3..V-1, loss_mask [T] int64: 0 on
                                            the first half, 1 on the second (the supervised "answer")}
    collate_with_anchors(items, A, device)  ({input_ids, loss_mask, attention_mask: [B, T] on the device},
                                            anchors: B sorted int64 tensors [n_b], n_b <= A)
    synthetic_batch(shape, device)          the two above for a step shape (dflash.model.shapes.STEP_SHAPES):
                                            B = shape["batch"], T = shape["seq"], A = shape["anchors"]
"""

from __future__ import annotations

import torch

from dflash.data.batches import collate
from dflash.batching.anchors import anchor_seed, sample_anchors


def synthetic_items(n: int, seq_len: int, vocab: int, seed: int = 0) -> list[dict]:
    """`n` sequences of `seq_len` random tokens (ids 3..vocab-1, clear of pad, eos and a mask id 2); the
    second half of each is the supervised "answer"."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        mask = torch.zeros(seq_len, dtype=torch.long)
        mask[seq_len // 2:] = 1
        items.append({"input_ids": torch.randint(3, vocab, (seq_len,), generator=g), "loss_mask": mask})
    return items


def collate_with_anchors(items: list[dict], max_anchors: int, device: torch.device) -> tuple[dict, list[torch.Tensor]]:
    """(batch on the device, anchors) of these items, the anchors sampled as the trainer samples them
    (seed 0, epoch 0, item i as sample i: dflash.batching.anchors.anchor_seed(0, 0, i))."""
    batch = {k: v.to(device) for k, v in collate(items, 0).items()}
    anchors = [sample_anchors(it["loss_mask"], max_anchors, torch.Generator().manual_seed(anchor_seed(0, 0, i)))
               for i, it in enumerate(items)]
    return batch, anchors


def synthetic_batch(shape: dict, device: torch.device) -> tuple[dict, list[torch.Tensor]]:
    """Random ids of a step shape, the second half of each sequence supervised; anchors sampled as the
    trainer samples them."""
    return collate_with_anchors(synthetic_items(shape["batch"], shape["seq"], shape["vocab"]), shape["anchors"],
                                device)
