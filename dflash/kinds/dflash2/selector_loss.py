"""The DFlash2 training objective: DFlash's block loss on the unary logits plus a K-way selector loss.

For each scored block slot k (1..bs-1) with label y_k and position weight w_k = exp(-(k-1)/gamma):

    loss_sum = sum w_k * CE(unary_k, y_k)                                  DFlash's loss, over the vocabulary
             + alpha * sum w_k * m_k * CE(S_k(y_{k-1}, candidates_k), index of y_k)
    weight   = sum w_k                                                     (loss = loss_sum / weight)

unary_k = lm_head(h_k) * output_multiplier, soft-capped (dflash.kinds.dflash2.selector.unary_logits); the
candidates are unary_k's top K; the predecessor is teacher-forced: the true token before slot k (the
anchor for k = 1), which is what the decode-time walk holds while every earlier slot was right.

SELECTOR_MISSING picks what happens when y_k is not among the K candidates:
  "drop"    m_k = 0: the slot gives the selector no signal (NeMo Automodel 0.7.0,
            components/speculative/dflash/dflash2_core.py, DFlash2TrainerModule) - the default;
  "inject"  y_k replaces the K-th candidate (its unary logit beside it), m_k = 1 (vLLM speculators 0.9.0,
            models/dflash2/metrics.py, selector_training_candidates).
Both published objectives normalise the selector term by its own weights; here it shares the DFlash
term's denominator (the step's sums add up over micro-batches and ranks), i.e. NeMo's term times the
candidate recall. alpha = 1, both references' default.

`correct` is the slot's teacher-forced selector pick (what the drafter proposes at temperature 0 while
the walk is on the true path) equal to y_k, and y_k among the unary candidates (a token the engines
could propose); the trainer's accuracy and acceptance figures are the selector path's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash.objective.losses import block_weights

SELECTOR_MISSING = ("drop", "inject")
SELECTOR_ALPHA = 1.0
CHUNK_ROWS = 1024  # scored rows whose full-vocabulary logits exist at once (recomputed in the backward)


def _chunk(drafter, head, rows, targets, preds, row_w, alpha: float, missing: str):
    logits = drafter.unary(head(rows).float())                                         # [m,V] float32
    ce = F.cross_entropy(logits, targets, reduction="none")
    values, candidates = logits.topk(drafter.candidate_selector.top_k, dim=-1)         # [m,K]
    hit = candidates == targets.unsqueeze(-1)
    present = hit.any(-1)
    if missing == "inject":
        candidates = candidates.clone()
        candidates[:, -1] = torch.where(present, candidates[:, -1], targets)
        values = torch.cat([values[:, :-1], torch.where(present, values[:, -1], logits.gather(-1, targets[:, None])
                                                        .squeeze(-1)).unsqueeze(-1)], dim=-1)
        index, weight = torch.where(present, hit.long().argmax(-1), values.shape[-1] - 1), row_w
    else:
        index, weight = hit.long().argmax(-1), row_w * present
    scores = drafter.candidate_selector.scores(rows, values, candidates, preds)        # [m,K]
    selector_ce = F.cross_entropy(scores, index, reduction="none")
    total = (row_w * ce).sum() + alpha * (weight * selector_ce).sum()
    picked = candidates.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
    return total, (picked == targets) & present


def dflash2_sums(drafter, hidden: torch.Tensor, head, block_ids: torch.Tensor, labels: torch.Tensor,
                 valid: torch.Tensor, gamma: float | None, *, missing: str = "drop",
                 alpha: float = SELECTOR_ALPHA, chunk_rows: int = CHUNK_ROWS):
    """hidden [B,N,bs,H] (the DFlash2Drafter's output), head: the target's LM head, block_ids [B,N,bs],
    labels/valid [B,N,bs-1] -> (loss_sum [] with a graph, weight [], correct [B,N,bs-1] bool), the
    shapes of dflash.objective.head_loss.fused_weighted_ce."""
    if missing not in SELECTOR_MISSING:
        raise ValueError(f"missing must be one of {', '.join(SELECTOR_MISSING)}, not {missing!r}")
    H = hidden.shape[-1]
    valid, w = block_weights(hidden, labels, valid, gamma, "hidden")                   # [B,N,bs-1]
    preds = torch.cat([block_ids[..., :1], labels[..., :-1]], dim=-1)                  # token before slot k
    index = valid.flatten().nonzero().squeeze(-1)
    rows = hidden[:, :, 1:, :].reshape(-1, H).index_select(0, index)
    targets, row_w, preds = (t.flatten().index_select(0, index) for t in (labels, w, preds))
    total = hidden.new_zeros((), dtype=torch.float32)
    correct = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    for start in range(0, rows.shape[0], chunk_rows):
        part = slice(start, start + chunk_rows)
        args = (drafter, head, rows[part], targets[part], preds[part], row_w[part], alpha, missing)
        if torch.is_grad_enabled() and rows.requires_grad:
            loss, hit = checkpoint(_chunk, *args, use_reentrant=False)
        else:
            loss, hit = _chunk(*args)
        total = total + loss
        correct[index[part]] = hit
    return total, w.sum(), correct.view(valid.shape)
