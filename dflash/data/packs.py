"""Packed micro-batches: whole sequences back to back in rows of a fixed token budget, so every micro-batch
has the same shapes (one compile, the same memory every step) and carries no padding but a row's tail.

    make_packs(lengths, pack_tokens, seed, epoch)   sample indices of each pack; every pack <= pack_tokens
    PackOrder                                       walks the packs epoch after epoch, `per_batch` at a time
                                                    (one per rank: each rank trains its own pack)
    collate_pack(items, pad_id, pack_tokens)        one pack -> input_ids, loss_mask, attention_mask [1,T]
                                                    and its Segments (dflash.model.segments), T = pack_tokens

Packing is best-fit decreasing inside pools of shuffled sequences: the same (seed, epoch) always gives the
same packs, each epoch mixes the sequences differently, and the pools keep the packing tight (a pool of
4096 sequences of a chat-like length mix fills its packs to about 98 %). A sequence longer than a pack
cannot be packed: the config refuses --pack-tokens below --max-length, which truncates every sequence.
"""

from __future__ import annotations

import bisect
import random

import torch

from dflash.errors import TrainError
from dflash.model.segments import Segments

POOL = 4096  # sequences packed together before the pack order is shuffled


def make_packs(lengths: list[int], pack_tokens: int, seed: int, epoch: int, pool: int = POOL) -> list[list[int]]:
    """Packs of sample indices, each adding up to at most `pack_tokens` tokens; the same (seed, epoch) always
    gives the same list. Within a pool the longest sequence goes first, each into the fullest pack it still fits."""
    if not lengths:
        return []
    if max(lengths) > pack_tokens:
        raise ValueError(f"a sequence of {max(lengths)} tokens does not fit a pack of {pack_tokens}; raise "
                         "--pack-tokens to at least --max-length")
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    packs: list[list[int]] = []
    for start in range(0, len(order), pool):
        opened: list[list[int]] = []
        rooms: list[tuple[int, int]] = []  # (free tokens, pack number), ascending
        for i in sorted(order[start:start + pool], key=lambda i: (-lengths[i], i)):
            at = bisect.bisect_left(rooms, (lengths[i], -1))  # the fullest pack it still fits (best fit)
            if at == len(rooms):
                opened.append([i])
                bisect.insort(rooms, (pack_tokens - lengths[i], len(opened) - 1))
                continue
            free, p = rooms.pop(at)
            opened[p].append(i)
            bisect.insort(rooms, (free - lengths[i], p))
        packs.extend(opened)
    rng.shuffle(packs)
    return packs


def fill(lengths: list[int], packs: list[list[int]], pack_tokens: int) -> float:
    """Share of the packs' token budget real tokens fill (1 = no padding)."""
    return sum(lengths[i] for pack in packs for i in pack) / max(1, len(packs) * pack_tokens)


class PackOrder:
    """Walks the packs epoch after epoch, `per_batch` packs per global micro-batch (one per rank). Its
    position is counted in packs (state(): epoch and batch_index, the packs used of that epoch), so a run
    resumed on another number of ranks goes on from the same pack."""

    def __init__(self, lengths: list[int], pack_tokens: int, per_batch: int, seed: int, epoch: int = 0,
                 index: int = 0):
        self._make = lambda e: make_packs(lengths, pack_tokens, seed, e)
        self.per_batch = per_batch
        self.epoch, self.index = epoch, index
        self._packs = self._make(epoch)
        if not self._packs:
            raise TrainError("the data gives no pack; check --data and --pack-tokens")

    @property
    def batches_per_epoch(self) -> int:
        return -(-len(self._packs) // self.per_batch)

    def next(self) -> tuple[int, list[list[int]]]:
        """(epoch, the packs of the next global micro-batch: up to `per_batch` lists of sample indices)."""
        if self.index >= len(self._packs):
            self.epoch, self.index = self.epoch + 1, 0
            self._packs = self._make(self.epoch)
        batch = self._packs[self.index:self.index + self.per_batch]
        self.index += len(batch)
        return self.epoch, [list(pack) for pack in batch]

    def state(self) -> dict:
        return {"epoch": self.epoch, "batch_index": self.index}


def collate_pack(items: list[dict[str, torch.Tensor]], pad_id: int, pack_tokens: int) -> dict:
    """One pack: the items' tokens back to back, then `pad_id` up to `pack_tokens`.

    Returns input_ids, loss_mask, attention_mask (1 on real tokens) [1, pack_tokens] and "segments"
    (Segments: positions restarting per item, the padding tail a segment of its own)."""
    lengths = [len(item["input_ids"]) for item in items]
    if not items or sum(lengths) > pack_tokens:
        raise ValueError(f"items of {sum(lengths)} tokens do not fit a pack of {pack_tokens}")
    real = sum(lengths)
    input_ids = torch.full((1, pack_tokens), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((1, pack_tokens), dtype=torch.long)
    attention_mask = torch.zeros((1, pack_tokens), dtype=torch.long)
    input_ids[0, :real] = torch.cat([item["input_ids"] for item in items])
    loss_mask[0, :real] = torch.cat([item["loss_mask"] for item in items])
    attention_mask[0, :real] = 1
    return {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask,
            "segments": Segments.from_lengths([lengths], pack_tokens)}


def per_sequence(anchors: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """A pack's sorted anchor positions [n] -> one tensor per sequence, counted from that sequence's start
    (what per-sequence accounting, such as the step's model FLOPs, reads)."""
    out, start = [], 0
    for n in lengths:
        inside = anchors[(anchors >= start) & (anchors < start + n)]
        out.append(inside - start)
        start += n
    return out
