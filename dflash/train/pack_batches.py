"""This rank's packed micro-batch: its pack of the global micro-batch, collated, with the pack's anchors.

    global micro-batch   world-size packs (dflash.data.packs.PackOrder), rank r trains pack r
    a rank without one   trains a copy of the first pack with its loss mask zeroed (weight 0: it keeps the
                         collectives in step and changes no gradient), as the padded path's stand-in does
    anchors              up to --pack-anchors over the pack's supervised positions (blocks.sample_pack_anchors),
                         from a generator seeded by the pack's first sequence: the same anchors on any rank,
                         in any run that forms the same pack
"""

from __future__ import annotations

import torch

from dflash.data.packs import collate_pack, per_sequence
from dflash.train.blocks import anchor_seed, sample_pack_anchors


def rank_pack(packs: list[list[int]], items, rank: int) -> tuple[list[int], list[dict], bool]:
    """(sample indices, items, stand_in) of this rank's pack of a global micro-batch."""
    stand_in = rank >= len(packs)
    mine = packs[0] if stand_in else packs[rank]
    chosen = [items[i] for i in mine]
    if stand_in:
        chosen = [{**item, "loss_mask": torch.zeros_like(item["loss_mask"])} for item in chosen]
    return mine, chosen, stand_in


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
