"""The drafter's attention mask: which block token may look at which context position or block token.

Layout. Queries are the block tokens only; keys/values are the T context features followed by the
same block tokens. Token k of the block anchored at a sits at absolute position p = a + k; context
position j sits at j. Example: T = 6 context positions, N = 2 blocks of bs = 3, anchors a0 = 2, a1 = 4.

full_attention layers (the default):

                        keys/values ->
                        context (T=6)         block 0    block 1
                        0  1  2  3  4  5      b0 b1 b2   b0 b1 b2
    queries  blk0 b0    x  x  .  .  .  .      x  x  x    .  .  .
     (N*bs)       b1    x  x  .  .  .  .      x  x  x    .  .  .
                  b2    x  x  .  .  .  .      x  x  x    .  .  .
             blk1 b0    x  x  x  x  .  .      .  .  .    x  x  x
                  b1    x  x  x  x  .  .      .  .  .    x  x  x
                  b2    x  x  x  x  .  .      .  .  .    x  x  x

sliding_attention layers, window W = 3 (a query at p sees keys at positions p-W+1 .. p):

                        0  1  2  3  4  5      b0 b1 b2   b0 b1 b2
             blk1 b0    .  .  x  x  .  .      .  .  .    x  .  .      p = 4: keys 2..4
                  b1    .  .  .  x  .  .      .  .  .    x  x  .      p = 5: keys 3..5
                  b2    .  .  .  .  .  .      .  .  .    x  x  x      p = 6: keys 4..6

Rules (x = may attend):
  1. block n, anchored at position a_n, sees context position j only if j < a_n (strictly: the anchor's
     own target state would leak the label of block position 1) and context_valid[j];
  2. full_attention: inside a block attention is bidirectional: every token sees all bs tokens of its block;
  3. blocks never see each other;
  4. an invalid anchor (anchor_valid False: padding of the anchor list) sees only its own block, so its
     rows stay finite (no all-masked softmax row) and its outputs are ignored by the loss;
  5. packed sequences (context_start given): block n also sees context position j only if
     j >= context_start[n], the first position of its anchor's own sequence (dflash.model.segments), so a
     block never reads another sequence of its pack;
  6. sliding_attention (window W): rules 1, 3, 4 and 5 hold, and a query at position p = a_n + k only sees
     keys at positions p-W+1 .. p, so inside the block it is causal (block token kk only if kk <= k)
     and the context is cut to j >= p-W+1. This is the window of HF `sliding_window` (it counts the
     query itself) and what the serving engines run for a `sliding_attention` draft layer: SGLang
     models/dflash.py (causal DECODER attention, window_left = sliding_window - 1), vLLM
     qwen3_dflash.py (causal iff sliding), SpecForge's DFlash training mask.
"""

from __future__ import annotations

import torch


def drafter_attention_mask(
    anchors: torch.Tensor,
    T: int,
    block_size: int,
    context_valid: torch.Tensor | None = None,
    anchor_valid: torch.Tensor | None = None,
    sliding_window: int | None = None,
    context_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask [B, N*bs, T + N*bs], True = may attend (rules in the module docstring).

    anchors:        [B,N] long, the anchor position of each block (0 <= a < T for valid anchors)
    T:              number of context positions
    block_size:     bs, tokens per block
    context_valid:  [B,T] bool (False on padding), or None = all valid
    anchor_valid:   [B,N] bool, or None = all valid
    sliding_window: W for a sliding_attention layer (keys at p-W+1 .. p), None for full_attention
    context_start:  [B,N] long, the first context position of each anchor's sequence (packed rows), or None
    """
    if anchors.dim() != 2:
        raise ValueError(f"anchors must be [B,N], got shape {tuple(anchors.shape)}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 (it counts the query itself), got {sliding_window}")
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
    if context_start is not None:
        if context_start.shape != (B, N):
            raise ValueError(f"context_start must be [B,N]={B, N}, got {tuple(context_start.shape)}")
        sees_context = sees_context & (j.view(1, 1, T) >= context_start.unsqueeze(-1))
    sees_context = sees_context.repeat_interleave(block_size, dim=1)              # [B,N*bs,T]

    # Block part [N*bs,N*bs]: block-diagonal, the same for every sequence.
    row = torch.arange(N * block_size, device=device)
    block_of, offset = row // block_size, row % block_size
    sees_block = block_of.view(-1, 1) == block_of.view(1, -1)                     # [N*bs,N*bs]

    if sliding_window is not None:
        W = sliding_window
        # Query position p = anchor + k; context j visible only from p-W+1 on.
        p = (anchors.unsqueeze(-1) + torch.arange(block_size, device=device)).reshape(B, N * block_size)
        sees_context = sees_context & (j.view(1, 1, T) >= p.unsqueeze(-1) - (W - 1))
        # Inside the block: causal, and at most W-1 tokens back (k - kk < W).
        back = offset.view(-1, 1) - offset.view(1, -1)
        sees_block = sees_block & (back >= 0) & (back < W)

    return torch.cat([sees_context, sees_block.expand(B, -1, -1)], dim=-1)
