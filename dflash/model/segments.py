"""Where each sequence of a packed batch starts and ends: what the target's layers and the drafter's mask
need so that no packed sequence sees another.

A pack is one row of T tokens holding whole sequences back to back, then padding up to T:

    row        [ s0 s0 s0 s0 | s1 s1 s1 | s2 s2 | pad pad pad ]
    positions    0  1  2  3    0  1  2    0  1    0   1   2      restart at every sequence (RoPE)
    seq_idx      0  0  0  0    1  1  1    2  2    3   3   3      segment number, counted over all rows
    cu_seqlens   [0, 4, 7, 9, 12]                                segment starts in the flattened B*T, then B*T
    starts       0  0  0  0    4  4  4    7  7    9   9   9      row position where the token's segment starts

The padding after the last sequence is a segment of its own: it starts after every real token, so a causal
model computes the real tokens as if it were not there. `Segments` carries the four views of one layout
(dflash.model.target hands the first three to the target's layers, dflash.model.masks uses `starts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segments:
    """The sequence layout of a [B,T] batch of packs (module docstring)."""

    position_ids: torch.Tensor  # [B,T] long: position inside the token's own sequence
    seq_idx: torch.Tensor       # [B,T] int32: segment number, increasing over the flattened B*T
    cu_seqlens: torch.Tensor    # [S+1] int32: segment starts in the flattened B*T, then B*T
    starts: torch.Tensor        # [B,T] long: row position where the token's segment starts
    max_seqlen: int             # the longest segment (padding segments included)

    @classmethod
    def from_lengths(cls, lengths: list[list[int]], T: int, device=None) -> "Segments":
        """The layout of B rows of T tokens, row b holding sequences of `lengths[b]` tokens from position 0
        on; the rest of a row (T - sum) is one padding segment. A row whose lengths add up to more than T is
        a ValueError."""
        positions, seq_idx, starts, cu = [], [], [], [0]
        segment = 0
        for b, row in enumerate(lengths):
            if any(n < 1 for n in row) or sum(row) > T:
                raise ValueError(f"row {b}: sequence lengths {row} must be >= 1 each and add up to <= T={T}")
            parts = list(row) + ([T - sum(row)] if sum(row) < T else [])
            at = 0
            for n in parts:
                positions.append(torch.arange(n))
                seq_idx.append(torch.full((n,), segment, dtype=torch.int32))
                starts.append(torch.full((n,), at, dtype=torch.long))
                cu.append(cu[-1] + n)
                at, segment = at + n, segment + 1
        B = len(lengths)
        return cls(position_ids=torch.cat(positions).view(B, T).to(device),
                   seq_idx=torch.cat(seq_idx).view(B, T).to(device),
                   cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
                   starts=torch.cat(starts).view(B, T).to(device),
                   max_seqlen=max(b - a for a, b in zip(cu, cu[1:])))

    def to(self, device) -> "Segments":
        return Segments(self.position_ids.to(device), self.seq_idx.to(device), self.cu_seqlens.to(device),
                        self.starts.to(device), self.max_seqlen)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.position_ids.shape)
