"""Blocks: what the drafter is shown and scored on at each anchor (the anchors: dflash.batching.anchors).

For a micro-batch of sequences input_ids [B,T] with loss mask [B,T] and each sequence's anchors:

    blocks    [input_ids[a], MASK, MASK, ..., MASK]                              [B, N, bs]
    labels    input_ids[a+1 .. a+bs-1]  (valid: inside the sequence, loss_mask 1)  [B, N, bs-1]

N is the most anchors of any sequence in the micro-batch; shorter rows are padded with invalid anchors. A
packed row (dflash.data.packs) holds several sequences: N is its fixed anchor budget in every micro-batch,
and a label counts only inside its anchor's own sequence (build_blocks' `seq_idx`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Blocks:
    """The drafter's inputs for one micro-batch (N = most anchors of any sequence in it)."""

    anchors: torch.Tensor       # [B,N] long, 0 where padded
    anchor_valid: torch.Tensor  # [B,N] bool
    block_ids: torch.Tensor     # [B,N,bs] long: [anchor token, MASK x (bs-1)]
    labels: torch.Tensor        # [B,N,bs-1] long: input_ids[a+1 .. a+bs-1] (0 where out of range)
    label_valid: torch.Tensor   # [B,N,bs-1] bool


def build_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: list[torch.Tensor],
                 block_size: int, mask_token_id: int, *, n_anchors: int | None = None,
                 seq_idx: torch.Tensor | None = None) -> Blocks:
    """input_ids, loss_mask [B,T] (right-padded, loss_mask 0 on padding) + per-row anchors [n_b] -> Blocks.

    A batch whose rows have no anchor at all still gets N = 1 (an invalid anchor at 0) so the drafter
    runs and DDP sees every parameter in the backward pass. `n_anchors` fixes N (packed rows: the anchor
    budget, so every micro-batch has the same shapes); `seq_idx` [B,T] (packed rows) makes a label valid
    only inside its anchor's sequence.
    """
    B, T = input_ids.shape
    N = max(1, max(int(a.numel()) for a in anchors))
    if n_anchors is not None:
        if N > n_anchors:
            raise ValueError(f"a row has {N} anchors, more than n_anchors={n_anchors}")
        N = n_anchors
    anchor_t = torch.zeros(B, N, dtype=torch.long)
    anchor_valid = torch.zeros(B, N, dtype=torch.bool)
    for b, a in enumerate(anchors):
        anchor_t[b, : a.numel()] = a
        anchor_valid[b, : a.numel()] = True
    anchor_t, anchor_valid = anchor_t.to(input_ids.device), anchor_valid.to(input_ids.device)
    offsets = torch.arange(1, block_size, device=input_ids.device)
    pos = anchor_t.unsqueeze(-1) + offsets                       # [B,N,bs-1]
    in_range = pos < T
    pos = pos.clamp(max=T - 1)
    flat = pos.view(B, -1)
    labels = torch.gather(input_ids, 1, flat).view_as(pos)
    supervised = torch.gather(loss_mask, 1, flat).view_as(pos).bool()
    label_valid = in_range & supervised & anchor_valid.unsqueeze(-1)
    if seq_idx is not None:
        same = torch.gather(seq_idx, 1, flat).view_as(pos) == torch.gather(seq_idx, 1, anchor_t).unsqueeze(-1)
        label_valid = label_valid & same
    block_ids = torch.full((B, N, block_size), mask_token_id, dtype=torch.long, device=input_ids.device)
    block_ids[:, :, 0] = torch.gather(input_ids, 1, anchor_t)
    return Blocks(anchor_t, anchor_valid, block_ids, labels.masked_fill(~label_valid, 0), label_valid)
