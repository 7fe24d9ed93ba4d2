"""This rank's share of a global micro-batch, in training and in evaluation alike, and the one rule that keeps
every rank's collectives in step whatever data it holds.

Every rank walks the same global micro-batches (training: the data order, dflash.data.batches.DataOrder or
dflash.data.packs.PackOrder; evaluation: the split's batches or packs, dflash.train.evaluation), so every rank
runs as many micro-batches, and in each:

    padded     rank r takes sequences r, r+W, r+2W, ... of the batch (dflash.distributed.shard)
    packed     rank r takes pack r of the global micro-batch's packs
    nothing    (fewer sequences or packs than ranks: a small batch, the end of an epoch or of the evaluation
               split, a split of one long conversation) the rank runs a stand-in: the first rank's share with
               its loss mask zeroed. It has no anchor and weight 0, `counted` drops its sums (its tokens are
               not data) and its model FLOPs go uncounted, so it changes no gradient and no statistic; but
               the drafter runs on it, so its collectives (DDP's gradient all-reduce, FSDP2's gathers and
               reduce-scatters, the loss weight's all-reduce, a pipeline's sends to the target stages) run on
               every rank as often.

No rank ever skips a micro-batch: a rank that skipped one would wait in a collective the others never reach.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash import distributed


@dataclass(frozen=True)
class Share:
    """This rank's part of one global micro-batch."""

    indices: list[int]  # the sample indices it holds (a stand-in: those of the share it copies)
    items: list[dict]   # their items ({input_ids, loss_mask}); a stand-in's with the loss mask zeroed
    stand_in: bool      # the micro-batch had nothing for this rank

    def counted(self, sums: torch.Tensor) -> torch.Tensor:
        """What it adds to a step's or an evaluation's sums (StepSums.pack): nothing for a stand-in."""
        return torch.zeros_like(sums) if self.stand_in else sums


def _share(mine: list[int], first: list[int], items) -> Share:
    """The rule: this rank's indices `mine`, or, when it has none, a zero-weight copy of the first rank's."""
    if mine:
        return Share(mine, [items[i] for i in mine], stand_in=False)
    copies = [{**items[i], "loss_mask": torch.zeros_like(items[i]["loss_mask"])} for i in first]
    return Share(first, copies, stand_in=True)


def padded_share(batch: list[int], items, d: distributed.Dist) -> Share:
    """This rank's sequences of a padded global micro-batch (`batch`: its sample indices)."""
    return _share(distributed.shard(batch, d), batch[::d.world_size], items)  # rank 0's: here, just batch[0]


def packed_share(packs: list[list[int]], items, d: distributed.Dist) -> Share:
    """This rank's pack of a packed global micro-batch (`packs`: up to world-size packs of sample indices)."""
    return _share(packs[d.rank] if d.rank < len(packs) else [], packs[0], items)
