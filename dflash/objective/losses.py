"""The DFlash training loss: position-weighted cross-entropy over the masked block positions.

A block is [anchor, MASK x (bs-1)]; position k = 1..bs-1 is trained to predict the token k steps after
the anchor. Speculative decoding accepts a prefix, so an early position matters more than a late one
(a miss at k makes every later position worthless): position k gets weight w_k = exp(-(k-1)/gamma).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

# gamma per block size from the upstream recipes (SpecForge --loss-decay-gamma): 16 -> 7, 10 -> 5, 8 -> 4.
_KNOWN_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


def default_gamma(block_size: int) -> float:
    """gamma for `block_size`: the upstream value where one exists, else the line through them.

    Between the known points gamma is interpolated linearly; below 8 it is bs/2 (the 8 -> 4 ratio),
    above 16 it grows by 1/3 per position (the slope between 10 and 16).
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (an anchor and at least one masked token), got {block_size}")
    if block_size in _KNOWN_GAMMA:
        return _KNOWN_GAMMA[block_size]
    if block_size < 8:
        return block_size / 2
    if block_size > 16:
        return 7.0 + (block_size - 16) / 3
    lo = max(k for k in _KNOWN_GAMMA if k < block_size)
    hi = min(k for k in _KNOWN_GAMMA if k > block_size)
    t = (block_size - lo) / (hi - lo)
    return _KNOWN_GAMMA[lo] + t * (_KNOWN_GAMMA[hi] - _KNOWN_GAMMA[lo])


def position_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """[bs-1] float32: w_k = exp(-(k-1)/gamma) for block positions k = 1..bs-1 (w_1 = 1)."""
    gamma = default_gamma(block_size) if gamma is None else float(gamma)
    if not gamma > 0 or math.isinf(gamma):
        raise ValueError(f"gamma must be a positive finite number, got {gamma}")
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def block_weights(scored: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, gamma: float | None,
                  what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid as bool, w [B,N,bs-1] float32 = w_k where valid else 0) for `scored` [B,N,bs,X] (`what` names
    it in the error), after checking that labels and valid are [B,N,bs-1]."""
    B, N, bs, _ = scored.shape
    if labels.shape != (B, N, bs - 1) or valid.shape != (B, N, bs - 1):
        raise ValueError(
            f"labels and valid must be [B,N,bs-1]={B, N, bs - 1} for {what} {tuple(scored.shape)}; got "
            f"{tuple(labels.shape)} and {tuple(valid.shape)}")
    valid = valid.bool()
    return valid, position_weights(bs, gamma).to(scored.device).expand(B, N, bs - 1) * valid


def dflash_loss(    logits: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    gamma: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """Weighted CE of block positions 1..bs-1; returns (loss scalar, stats).

    logits: [B,N,bs,V] drafter logits for every block token (position 0, the anchor, is not scored)
    labels: [B,N,bs-1] long, the token at anchor+k for k = 1..bs-1
    valid:  [B,N,bs-1] bool, False where the label is padding, past the end, or not supervised
    loss  = sum(w_k * CE * valid) / sum(w_k * valid)   (0 with a graph when nothing is valid)
    stats = {"acc_per_pos": [bs-1] float32, top-1 accuracy per position (0 where no valid label),
             "acc": [] float64, top-1 accuracy over all valid labels, "n_valid": [] long, valid labels,
             "tau_est": [] float32, 1 + mean accepted prefix over fully valid blocks (what greedy
                        verification would accept from these blocks; 0.0 when no block is fully valid;
                        not decoding's tau, whose steps start elsewhere: dflash.train.evaluation)}
    The stats are tensors on the logits' device: reading them (float(), int()) is the caller's choice,
    so a training step that does not need them never waits for the device.
    """
    B, N, bs, V = logits.shape
    valid, w = block_weights(logits, labels, valid, gamma, "logits")                # [B,N,bs-1]
    scored = logits[:, :, 1:, :]                                                    # [B,N,bs-1,V]

    # CE only where valid: labels elsewhere may be padding ids outside the vocabulary.
    ce = torch.zeros(B, N, bs - 1, dtype=torch.float32, device=logits.device)
    if valid.any():
        ce[valid] = F.cross_entropy(scored[valid].float(), labels[valid], reduction="none")
    denom = w.sum()
    loss = (ce * w).sum() / denom if denom > 0 else scored.sum() * 0.0

    with torch.no_grad():
        correct = (scored.argmax(-1) == labels) & valid                            # [B,N,bs-1]
    return loss, _stats(correct, valid)


def _stats(correct: torch.Tensor, valid: torch.Tensor) -> dict:
    """Accuracy per position, overall, and the greedy acceptance estimate, from [B,N,bs-1] masks.

    Computed on the device without boolean indexing or .item(): no host sync.
    """
    n_per_pos = valid.sum(dim=(0, 1))                                              # [bs-1]
    acc_per_pos = correct.sum(dim=(0, 1)).float() / n_per_pos.clamp(min=1)
    n_valid = valid.sum()
    acc = correct.sum().double() / n_valid.clamp(min=1).double()
    full = valid.all(dim=-1)                                                       # [B,N]
    n_full = full.sum()
    prefix = correct.long().cumprod(dim=-1).sum(dim=-1)                            # [B,N]
    mean_prefix = (prefix * full).sum().float() / n_full.clamp(min=1).float()
    tau_est = torch.where(n_full > 0, 1 + mean_prefix, torch.zeros_like(mean_prefix))
    return {"acc_per_pos": acc_per_pos, "acc": acc, "n_valid": n_valid, "tau_est": tau_est}


# Rows of the LM head's output alive at once in dflash_loss_from_hidden: 2048 x a 152K vocabulary is
# 0.6 GB in bf16 (+1.2 GB for the float32 cross-entropy), instead of anchors x block size rows.
LOSS_CHUNK_ROWS = 2048


def _chunk_ce(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden)
    return F.cross_entropy(logits.float(), labels, reduction="none"), logits.argmax(-1)


def weighted_ce_from_hidden(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    valid: torch.Tensor,
    gamma: float | None = None,
    chunk_rows: int = LOSS_CHUNK_ROWS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The un-normalised DFlash loss from drafter hidden states: (ce_sum [], weight [], correct [B,N,bs-1]).

    hidden: [B,N,bs,H] drafter hidden states (after the final norm); head: the target's LM head.
    labels: [B,N,bs-1] long; valid: [B,N,bs-1] bool (see dflash_loss).
    ce_sum  = sum(w_k * CE * valid), float32, with a graph even when nothing is valid
    weight  = sum(w_k * valid), float32 (no graph): ce_sum / weight is dflash_loss's loss
    correct = top-1 prediction == label, and valid (no graph)
    The head runs only on the positions that are scored (block positions 1..bs-1 with a valid label),
    `chunk_rows` rows at a time, each chunk under activation checkpointing: its [rows, V] logits exist
    in the forward only while its cross-entropy is taken and are recomputed in the backward.
    """
    valid, w = block_weights(hidden, labels, valid, gamma, "hidden")                     # [B,N,bs-1]
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    from torch.utils.checkpoint import checkpoint

    rows, targets, row_w = hidden[:, :, 1:, :][valid], labels[valid], w[valid]           # [M,H], [M], [M]
    predicted = torch.empty_like(targets)
    total = hidden.sum() * 0.0  # keeps a graph when nothing is valid
    if rows.shape[0] <= chunk_rows:  # one chunk: nothing to save by recomputing it in the backward
        ce, predicted = _chunk_ce(head, rows, targets)
        total = total + (ce * row_w).sum()
    else:
        for start in range(0, rows.shape[0], chunk_rows):
            part = slice(start, start + chunk_rows)
            ce, predicted[part] = checkpoint(_chunk_ce, head, rows[part], targets[part], use_reentrant=False)
            total = total + (ce * row_w[part]).sum()
    with torch.no_grad():
        correct = torch.zeros_like(valid)
        correct[valid] = predicted == targets
    return total, w.sum(), correct


def dflash_loss_from_hidden(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    valid: torch.Tensor,
    gamma: float | None = None,
    chunk_rows: int = LOSS_CHUNK_ROWS,
) -> tuple[torch.Tensor, dict]:
    """dflash_loss(head(hidden), labels, valid, gamma) without the full logits tensor.

    hidden: [B,N,bs,H]; the head runs as in weighted_ce_from_hidden. Same loss, gradients and stats as
    dflash_loss (up to float summation order).
    """
    total, denom, correct = weighted_ce_from_hidden(hidden, head, labels, valid, gamma, chunk_rows)
    loss = total / denom if denom > 0 else total
    return loss, _stats(correct, valid.bool())
