"""Anchors and blocks: where the drafter is asked to guess, and what it is shown and scored on.

For a micro-batch of sequences input_ids [B,T] with loss mask [B,T]:

    anchors   up to max_anchors positions a per sequence with loss_mask[a] == loss_mask[a+1] == 1
    blocks    [input_ids[a], MASK, MASK, ..., MASK]                              [B, N, bs]
    labels    input_ids[a+1 .. a+bs-1]  (valid: inside the sequence, loss_mask 1)  [B, N, bs-1]

N is the most anchors of any sequence in the micro-batch; shorter rows are padded with invalid anchors.

A packed row (dflash.data.packs) holds several sequences: its anchors are sampled over all of them up to a
fixed budget (sample_pack_anchors), N is that budget in every micro-batch, and a label counts only inside
its anchor's own sequence (build_blocks' `segments`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def anchor_seed(seed: int, epoch: int, sample_index: int) -> int:
    """A per-sequence seed: the anchors of a sequence depend only on (seed, epoch, its index), never on
    which rank or micro-batch it lands in, so resumed and multi-process runs sample the same anchors."""
    return (seed * 1_000_003 + epoch * 7_919 + sample_index * 104_729) % (2**63 - 1)


def sample_anchors(loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """[T] loss mask of one (unpadded) sequence -> sorted [n] anchor positions, n <= max_anchors.

    An anchor a needs loss_mask[a] == 1 and a+1 < T; we also require loss_mask[a+1] == 1, since an
    anchor whose first label is unsupervised adds a whole block of compute and no signal.
    """
    m = loss_mask.bool()
    candidates = torch.nonzero(m[:-1] & m[1:]).flatten()
    if candidates.numel() > max_anchors:
        pick = torch.randperm(candidates.numel(), generator=generator)[:max_anchors]
        candidates = candidates[pick.sort().values]
    return candidates


def sample_pack_anchors(loss_mask: torch.Tensor, seq_idx: torch.Tensor, budget: int,
                        generator: torch.Generator) -> torch.Tensor:
    """[T] loss mask and segment numbers of one packed row -> sorted [n] anchor positions, n <= budget.

    The candidates are sample_anchors' (loss_mask[a] == loss_mask[a+1] == 1) with a and a+1 in the same
    sequence; over the budget, a uniform sample of them, so every sequence of the pack gets anchors in
    proportion to its supervised tokens.
    """
    m = loss_mask.bool()
    candidates = torch.nonzero(m[:-1] & m[1:] & (seq_idx[:-1] == seq_idx[1:])).flatten()
    if candidates.numel() > budget:
        pick = torch.randperm(candidates.numel(), generator=generator)[:budget]
        candidates = candidates[pick.sort().values]
    return candidates


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
