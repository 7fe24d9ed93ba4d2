"""Packed rows: whole sequences back to back in one row of --pack-tokens tokens per rank (dflash.data.packs),
rank r training pack r of each global micro-batch, with up to --pack-anchors anchors over all the row's
sequences. Every micro-batch has the same shape (one compile, the same memory every step): the GPU's default.

    anchors   from a generator seeded by the pack's first sequence (dflash.batching.anchors): the same on any
              rank, in any run that forms the same pack, and the same for every drafter of the run
"""

from __future__ import annotations

import torch

from dflash.batching.anchors import EVAL_EPOCH, anchor_seed, sample_pack_anchors
from dflash.batching.base import Batching, RankBatch, on_device
from dflash.batching.shares import packed_share
from dflash.data.packs import PackOrder, collate_pack, make_packs, per_sequence
from dflash.errors import ConfigError


class Packed(Batching):
    name, flag, unit, anchors_flag = "packed", "on", "packs", "--pack-anchors"

    @classmethod
    def check(cls, config):
        """A pack shorter than --max-length would hold no full-length sequence."""
        if config.optim.pack_tokens < config.model.max_length:
            raise ConfigError(f"--pack-tokens {config.optim.pack_tokens} is below --max-length "
                              f"{config.model.max_length}: a full-length sequence would fit in no pack. Raise "
                              "--pack-tokens (or lower --max-length, or pass --packing off).")

    @property
    def title(self) -> str:
        optim = self.config.optim
        return f"packed rows of {optim.pack_tokens} tokens with {optim.pack_anchors} anchors"

    def order(self, lengths, world, epoch=0, index=0):
        optim = self.config.optim
        return PackOrder(lengths, optim.pack_tokens, world, optim.seed, epoch=epoch, index=index)

    def _row(self, config, epoch: int, share, pad_id: int, device) -> RankBatch:
        optim = config.optim
        batch = collate_pack(share.items, pad_id, optim.pack_tokens)
        g = torch.Generator().manual_seed(anchor_seed(optim.seed, epoch, share.indices[0]))
        anchors = sample_pack_anchors(batch["loss_mask"][0], batch["segments"].seq_idx[0], optim.pack_anchors, g)
        lengths = [len(item["input_ids"]) for item in share.items]
        return RankBatch(share, on_device(batch, device), [anchors], per_sequence(anchors, lengths))

    def take(self, epoch, indices, items, d, pad_id):
        return self._row(self.config, epoch, packed_share(indices, items, d), pad_id, d.device)

    def context(self, target, batch):
        return target.context(batch["input_ids"], segments=batch["segments"])

    def eval_rounds(self, config, items, d, pad_id):
        packs = make_packs([len(it["input_ids"]) for it in items], config.optim.pack_tokens, config.optim.seed,
                           epoch=0)
        for start in range(0, len(packs), d.world_size):
            yield self._row(config, EVAL_EPOCH, packed_share(packs[start:start + d.world_size], items, d), pad_id,
                            d.device)

    @property
    def n_anchors(self):
        return self.config.optim.pack_anchors

    @property
    def fixed_shape(self):
        return (1, self.config.optim.pack_tokens)

    def worst_shapes(self, world):
        return [(1, self.config.optim.pack_tokens, self.config.optim.pack_anchors)]

    def smaller(self, batch, anchors, world):
        return f"{anchors} anchors per pack fits (--pack-anchors {anchors})"

    def shrink_options(self):
        optim = self.config.optim
        return f"--pack-anchors (now {optim.pack_anchors}) or --pack-tokens (now {optim.pack_tokens})"

    def notes(self, compiled):
        """Padded-batch options the run set (not their defaults), which packed rows leave unused."""
        optim, model = self.config.optim, self.config.model
        defaults_optim, defaults_model = type(optim)(), type(model)()
        set_ = [flag for flag, value, default in (
            ("--batch-size", optim.batch_size, defaults_optim.batch_size),
            ("--max-tokens", optim.max_tokens, defaults_optim.max_tokens),
            ("--max-anchors", model.max_anchors, defaults_model.max_anchors)) if value != default]
        if not set_:
            return []
        return [f"{', '.join(set_)} only shape{'s' if len(set_) == 1 else ''} padded batches, and this run packs "
                f"(--packing {optim.packing}): each rank trains rows of --pack-tokens {optim.pack_tokens} with "
                f"--pack-anchors {optim.pack_anchors}; pass --packing off to train padded batches instead"]

    def state(self):
        return {**super().state(), "pack_tokens": self.config.optim.pack_tokens}

    def resumes(self, state):
        return super().resumes(state) and int(state.get("pack_tokens", 0)) == self.config.optim.pack_tokens

    @classmethod
    def resume_flags(cls, state):
        return f"--packing on --pack-tokens {int(state.get('pack_tokens', 0))}"
