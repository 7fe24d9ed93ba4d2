"""Padded batches: length-bucketed global micro-batches of at most --batch-size sequences and --max-tokens
padded tokens (dflash.data.batches), split over the ranks (rank r takes sequences r, r+W, ...), each sequence
with up to its drafter's own --max-anchors anchors. Every batch has its own shape: the CPU's default."""

from __future__ import annotations

import torch

from dflash.batching.anchors import EVAL_ANCHOR_SEED, anchor_seed, sample_anchors
from dflash.batching.base import Batching, RankBatch, on_device
from dflash.batching.shares import padded_share
from dflash.data.batches import DataOrder, collate, make_batches


def _per_sequence(share, max_anchors: int, seed_of) -> list[torch.Tensor]:
    """Each sequence's anchors, from a generator seeded by `seed_of(its sample index)`."""
    return [sample_anchors(item["loss_mask"], max_anchors, torch.Generator().manual_seed(seed_of(i)))
            for i, item in zip(share.indices, share.items)]


class Padded(Batching):
    name, flag, unit, title = "padded", "off", "padded batches", "padded length-bucketed batches"

    def order(self, lengths, world, epoch=0, index=0):
        optim = self.config.optim
        return DataOrder(lengths, optim.max_tokens, optim.batch_size, optim.seed, epoch=epoch, index=index)

    def take(self, epoch, indices, items, d, pad_id):
        share = padded_share(indices, items, d)
        return RankBatch(share, on_device(collate(share.items, pad_id), d.device))

    def anchors(self, rank_batch, config, epoch):
        """Each sequence's own anchors, from a generator seeded by its index: the same whatever else the
        run trains, on any rank."""
        anchors = _per_sequence(rank_batch.share, config.model.max_anchors,
                                lambda i: anchor_seed(config.optim.seed, epoch, i))
        return anchors, anchors

    def context(self, target, batch):
        return target.context(batch["input_ids"], batch["attention_mask"])

    def eval_rounds(self, config, items, d, pad_id):
        lengths = [len(it["input_ids"]) for it in items]
        for batch_ids in make_batches(lengths, config.optim.max_tokens, config.optim.batch_size, config.optim.seed,
                                      epoch=0):
            share = padded_share(batch_ids, items, d)
            anchors = _per_sequence(share, config.model.max_anchors, lambda i: EVAL_ANCHOR_SEED + i)
            yield RankBatch(share, on_device(collate(share.items, pad_id), d.device), anchors, anchors)

    def worst_shapes(self, world):
        """The largest micro-batch the data order can form, the worse of two: the long one (--batch-size
        sequences split over the ranks, at least one, of --max-length tokens, capped by --max-tokens) and the
        short one (every sequence a rank may get, each of the length that fills --max-tokens, each with its
        --max-anchors anchors: anchors are bounded per sequence)."""
        model, optim = self.config.model, self.config.optim
        per_rank = max(1, -(-optim.batch_size // world))
        # the most padded tokens a rank's share can hold: B sequences of at most max_tokens // B tokens each
        tokens = max(-(-b // world) * min(model.max_length, optim.max_tokens // b)
                     for b in range(1, optim.batch_size + 1))
        long = (max(1, min(per_rank, tokens // model.max_length)), model.max_length, model.max_anchors)
        seq = max(2, min(model.max_length, -(-tokens // per_rank)))
        short = (per_rank, seq, max(1, min(model.max_anchors, seq - 1)))
        return [long, short] if short != long else [long]

    def smaller(self, batch, anchors, world):
        return (f"{anchors} anchors per sequence and {batch} sequence(s) per rank fits (--max-anchors {anchors}, "
                f"--batch-size {batch * world})")

    def shrink_options(self):
        model, optim = self.config.model, self.config.optim
        return (f"--max-anchors (now {model.max_anchors}), --max-tokens (now {optim.max_tokens}), "
                f"--batch-size (now {optim.batch_size}) or --max-length (now {model.max_length})")

    def notes(self, compiled):
        if not compiled:
            return []
        return ["--packing off with compiled drafter layers: every new batch shape compiles (a long step), and "
                "past dynamo's recompile limit the layers run uncompiled, with more memory than the memory check "
                "assumes; --packing on keeps one shape"]
