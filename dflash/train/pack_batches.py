"""This rank's packed micro-batch: its pack of the global micro-batch (dflash.train.shares.packed_share: a rank
without one runs a zero-weight stand-in), collated, with the pack's anchors.

    global micro-batch   world-size packs (dflash.data.packs.PackOrder), rank r trains pack r
    anchors              up to --pack-anchors over the pack's supervised positions (blocks.sample_pack_anchors),
                         from a generator seeded by the pack's first sequence: the same anchors on any rank,
                         in any run that forms the same pack
"""

from __future__ import annotations

import torch

from dflash.data.packs import collate_pack, per_sequence
from dflash.train.blocks import anchor_seed, sample_pack_anchors


def pack_micro_batch(config, epoch: int, mine: list[int], items: list[dict], pad_id: int,
                     device: torch.device) -> tuple[dict, list[torch.Tensor], list[torch.Tensor]]:
    """(batch on `device` with its segments, [anchors] of the one row, the anchors per sequence counted from
    each sequence's start: what the step's model FLOPs read)."""
    optim = config.optim
    batch = collate_pack(items, pad_id, optim.pack_tokens)
    g = torch.Generator().manual_seed(anchor_seed(optim.seed, epoch, mine[0]))
    anchors = sample_pack_anchors(batch["loss_mask"][0], batch["segments"].seq_idx[0], optim.pack_anchors, g)
    lengths = [len(item["input_ids"]) for item in items]
    on_device = {k: v.to(device) for k, v in batch.items()}
    return on_device, [anchors], per_sequence(anchors, lengths)
