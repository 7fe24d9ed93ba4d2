"""Where a micro-batch's blocks start: anchor positions, sampled from a seed that depends only on the data.

    anchor_seed(seed, epoch, sample_index)   a per-sequence seed: the same anchors on any rank, in any run
    sample_anchors(loss_mask, max_anchors, g)            one sequence: up to max_anchors anchors
    sample_pack_anchors(loss_mask, seq_idx, budget, g)   one packed row: up to budget over all its sequences

An anchor a needs loss_mask[a] == loss_mask[a+1] == 1: an anchor whose first label is unsupervised adds a
whole block of compute and no signal. What a block holds is dflash.train.blocks'.
"""

from __future__ import annotations

import torch

EVAL_ANCHOR_SEED = 2**31 - 1  # padded evaluation: sequence i's anchors come from EVAL_ANCHOR_SEED + i, every time
EVAL_EPOCH = -1  # packed evaluation: the epoch its packs' anchors are seeded with (never a training epoch)


def anchor_seed(seed: int, epoch: int, sample_index: int) -> int:
    """A per-sequence seed: the anchors of a sequence depend only on (seed, epoch, its index), never on
    which rank or micro-batch it lands in, so resumed and multi-process runs sample the same anchors."""
    return (seed * 1_000_003 + epoch * 7_919 + sample_index * 104_729) % (2**63 - 1)


def _pick(candidates: torch.Tensor, budget: int, generator: torch.Generator) -> torch.Tensor:
    if candidates.numel() > budget:
        pick = torch.randperm(candidates.numel(), generator=generator)[:budget]
        candidates = candidates[pick.sort().values]
    return candidates


def sample_anchors(loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """[T] loss mask of one (unpadded) sequence -> sorted [n] anchor positions, n <= max_anchors (a + 1 < T)."""
    m = loss_mask.bool()
    return _pick(torch.nonzero(m[:-1] & m[1:]).flatten(), max_anchors, generator)


def sample_pack_anchors(loss_mask: torch.Tensor, seq_idx: torch.Tensor, budget: int,
                        generator: torch.Generator) -> torch.Tensor:
    """[T] loss mask and segment numbers of one packed row -> sorted [n] anchor positions, n <= budget.

    The candidates are sample_anchors' with a and a+1 in the same sequence; over the budget, a uniform sample
    of them, so every sequence of the pack gets anchors in proportion to its supervised tokens.
    """
    m = loss_mask.bool()
    return _pick(torch.nonzero(m[:-1] & m[1:] & (seq_idx[:-1] == seq_idx[1:])).flatten(), budget, generator)
