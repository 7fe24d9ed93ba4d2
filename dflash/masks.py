"""The drafter's attention mask: which block token may look at which context position or block token.

Layout. Queries are the block tokens only; keys/values are the T context features followed by the
same block tokens. Example: T = 6 context positions, N = 2 blocks of bs = 3, anchors a0 = 2, a1 = 4:

                        keys/values ->
                        context (T=6)         block 0    block 1
                        0  1  2  3  4  5      b0 b1 b2   b0 b1 b2
    queries  blk0 b0    x  x  .  .  .  .      x  x  x    .  .  .
     (N*bs)       b1    x  x  .  .  .  .      x  x  x    .  .  .
                  b2    x  x  .  .  .  .      x  x  x    .  .  .
             blk1 b0    x  x  x  x  .  .      .  .  .    x  x  x
                  b1    x  x  x  x  .  .      .  .  .    x  x  x
                  b2    x  x  x  x  .  .      .  .  .    x  x  x

Rules (x = may attend):
  1. block n, anchored at position a_n, sees context position j only if j < a_n (strictly: the anchor's
     own target state would leak the label of block position 1) and context_valid[j];
  2. inside a block attention is bidirectional: every token sees all bs tokens of its own block;
  3. blocks never see each other;
  4. an invalid anchor (anchor_valid False: padding of the anchor list) sees only its own block, so its
     rows stay finite (no all-masked softmax row) and its outputs are ignored by the loss.
"""

from __future__ import annotations

import torch


def drafter_attention_mask(
    anchors: torch.Tensor,
    T: int,
    block_size: int,
    context_valid: torch.Tensor | None = None,
    anchor_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask [B, N*bs, T + N*bs], True = may attend (rules in the module docstring).

    anchors:       [B,N] long, the anchor position of each block (0 <= a < T for valid anchors)
    T:             number of context positions
    block_size:    bs, tokens per block
    context_valid: [B,T] bool (False on padding), or None = all valid
    anchor_valid:  [B,N] bool, or None = all valid
    """
    if anchors.dim() != 2:
        raise ValueError(f"anchors must be [B,N], got shape {tuple(anchors.shape)}")
    B, N = anchors.shape
    device = anchors.device
    if context_valid is None:
        context_valid = torch.ones(B, T, dtype=torch.bool, device=device)
    if anchor_valid is None:
        anchor_valid = torch.ones(B, N, dtype=torch.bool, device=device)
    if context_valid.shape != (B, T) or anchor_valid.shape != (B, N):
        raise ValueError(
            f"context_valid must be [B,T]={B, T} and anchor_valid [B,N]={B, N}; got "
            f"{tuple(context_valid.shape)} and {tuple(anchor_valid.shape)}")

    # Context part [B,N,T]: j < anchor, j valid, anchor valid; then repeated for the bs rows of a block.
    j = torch.arange(T, device=device)
    sees_context = (j.view(1, 1, T) < anchors.unsqueeze(-1)) & context_valid.bool().unsqueeze(1)
    sees_context = sees_context & anchor_valid.bool().unsqueeze(-1)
    sees_context = sees_context.repeat_interleave(block_size, dim=1)              # [B,N*bs,T]

    # Block part [N*bs,N*bs]: block-diagonal, the same for every sequence.
    block_of = torch.arange(N * block_size, device=device) // block_size
    sees_block = (block_of.view(-1, 1) == block_of.view(1, -1)).expand(B, -1, -1)  # [B,N*bs,N*bs]

    return torch.cat([sees_context, sees_block], dim=-1)
