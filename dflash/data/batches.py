"""Training data for DFlash: conversations -> token ids + assistant-only loss mask -> length-bucketed batches.

    conversations (dflash.data.chat) --ChatDataset(tokenizer, max_length, block_size)--> items
        {input_ids [T], loss_mask [T]}      (loss mask: dflash.data.spans, from the single full render)
    --DataOrder: make_batches(lengths, max_tokens, batch_size, seed, epoch), epoch after epoch-->
        sample indices of each global micro-batch --collate--> padded [B,T] tensors
    load_items(config, target): --data of any size, tokenised in parallel and cached (dflash.data.token_cache)

Training on the target's own responses (not the dataset's) is what DFlash wants (dflash.regenerate):
the drafter must predict what *this* target says next. Samples with fewer than 2 x block_size
supervised tokens teach too few blocks and are dropped (SpecForge does the same), and every drop is
counted in a DataReport.
"""

from __future__ import annotations

import hashlib
import logging
import random

import torch

from dflash.data.chat import DataReport
from dflash.errors import DataError, TrainError
from dflash.data.spans import Unusable, assistant_char_spans, tokenize_conversation  # noqa: F401  (the API of this module)

log = logging.getLogger(__name__)


class ChatDataset(torch.utils.data.Dataset):
    """Tokenised conversations in memory; items are {"input_ids": LongTensor[T], "loss_mask": LongTensor[T]}.

    For the demo and tests; a run's --data goes through dflash.data.token_cache (parallel, cached). Samples
    with fewer than `min_supervised` (default 2 * block_size) assistant tokens after truncation are
    dropped and counted in `.report` (reason "too_few_supervised_tokens"); so are conversations that
    give no sample (dflash.data.spans.Unusable: "template_error", "no_assistant_turn", "empty_assistant_turn").
    A template with no way to locate assistant turns raises ChatTemplateError.
    """

    def __init__(self, conversations, tokenizer, *, max_length: int, block_size: int,
                 min_supervised: int | None = None, source: str = "chat dataset"):
        self.min_supervised = 2 * block_size if min_supervised is None else min_supervised
        self.report = DataReport(source=source)
        self.input_ids: list[list[int]] = []
        self.loss_masks: list[list[int]] = []
        for n, messages in enumerate(conversations, start=1):
            self.report.n_read += 1
            try:
                ids, mask = tokenize_conversation(tokenizer, messages, max_length)
            except Unusable as exc:
                self.report.skip(exc.reason, f"conversation {n}: {exc}")
                continue
            if sum(mask) < self.min_supervised:
                self.report.skip("too_few_supervised_tokens",
                                 f"conversation {n}: {sum(mask)} supervised tokens < {self.min_supervised}")
                continue
            self.input_ids.append(ids)
            self.loss_masks.append(mask)
            self.report.n_kept += 1
        if not self.input_ids:
            raise DataError(
                f"no usable samples: {self.report.summary()}; every sample needs >= {self.min_supervised} "
                f"assistant tokens within max_length={max_length}: use longer answers, raise max_length "
                "or lower block_size"
            )
        log.info("%s", self.report.summary())

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor(self.input_ids[i], dtype=torch.long),
                "loss_mask": torch.tensor(self.loss_masks[i], dtype=torch.long)}

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.input_ids]



# --------------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------------
def make_batches(lengths: list[int], max_tokens: int | None, batch_size: int, seed: int, epoch: int,
                 pool_batches: int = 64) -> list[list[int]]:
    """Length-bucketed batches of sample indices; the same (seed, epoch) always gives the same list.

    Indices are shuffled, cut into pools of `pool_batches * batch_size`, sorted by length inside each
    pool, and packed greedily into batches of at most `batch_size` samples and at most `max_tokens`
    padded tokens (batch size x longest sample; None = no token cap). The batch order is shuffled
    again, so neighbouring steps see different lengths. Sorting within pools (not globally) keeps
    padding low while every epoch still mixes samples differently.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not lengths:
        return []
    if max_tokens is not None and max_tokens < max(lengths):
        raise ValueError(f"max_tokens={max_tokens} is smaller than the longest sample ({max(lengths)} tokens); "
                         "raise max_tokens to at least that, or lower max_length")
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    pool = pool_batches * batch_size
    batches = []
    for start in range(0, len(order), pool):
        batch, longest = [], 0
        for i in sorted(order[start:start + pool], key=lengths.__getitem__):
            grown = max(longest, lengths[i])
            if batch and (len(batch) == batch_size or (max_tokens and grown * (len(batch) + 1) > max_tokens)):
                batches.append(batch)
                batch, grown = [], lengths[i]
            batch.append(i)
            longest = grown
        batches.append(batch)
    rng.shuffle(batches)
    log.debug("epoch %d: %d batches, %.1f%% padding", epoch, len(batches), 100 * padding_fraction(lengths, batches))
    return batches


def padding_fraction(lengths: list[int], batches: list[list[int]]) -> float:
    """Share of padded positions in `batches` (0 = no padding): 1 - real tokens / (B x T summed)."""
    real = sum(lengths[i] for batch in batches for i in batch)
    padded = sum(len(batch) * max(lengths[i] for i in batch) for batch in batches)
    return 1.0 - real / padded if padded else 0.0



def collate(items: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad items to the longest: input_ids [B,T] (pad_id), loss_mask [B,T] (0), attention_mask [B,T]."""
    if not items:
        raise ValueError("cannot collate an empty batch")
    longest = max(len(item["input_ids"]) for item in items)
    input_ids = torch.full((len(items), longest), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(items), longest), dtype=torch.long)
    attention_mask = torch.zeros((len(items), longest), dtype=torch.long)
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        input_ids[row, :n] = item["input_ids"]
        loss_mask[row, :n] = item["loss_mask"]
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask}



class DataOrder:
    """Walks the length-bucketed micro-batches epoch after epoch; its position is checkpointed."""

    def __init__(self, lengths: list[int], max_tokens: int | None, batch_size: int, seed: int,
                 epoch: int = 0, index: int = 0):
        self._make = lambda e: make_batches(lengths, max_tokens, batch_size, seed, e)
        self.epoch, self.index = epoch, index
        self._batches = self._make(epoch)
        if not self._batches:
            raise TrainError("the data gives no micro-batch; check --max-tokens and --batch-size")

    @property
    def batches_per_epoch(self) -> int:
        return len(self._batches)

    def next(self) -> tuple[int, list[int]]:
        """(epoch, sample indices of the next global micro-batch)."""
        if self.index >= len(self._batches):
            self.epoch, self.index = self.epoch + 1, 0
            self._batches = self._make(self.epoch)
        batch = self._batches[self.index]
        self.index += 1
        return self.epoch, list(batch)

    def state(self) -> dict:
        return {"epoch": self.epoch, "batch_index": self.index}


def data_fingerprint(items) -> str:
    """16 hex digits over every sequence's tokens and loss mask: resume refuses changed data. Items from
    the token cache carry theirs (its key: data content, tokenizer, max length, span rules)."""
    if getattr(items, "fingerprint", None):
        return items.fingerprint
    h = hashlib.sha256()
    for item in items:
        h.update(item["input_ids"].to(torch.int64).numpy().tobytes())
        h.update(item["loss_mask"].to(torch.int8).numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------------------
# Loading a run's training items
# --------------------------------------------------------------------------------------------------
def item_lengths(items) -> list[int]:
    """Token count of every item. The token cache's TokenizedItems carries them (`.lengths`, no row read);
    a plain list of items is measured."""
    lengths = getattr(items, "lengths", None)
    return list(lengths) if lengths is not None else [len(it["input_ids"]) for it in items]


def load_items(config, target):
    """The run's items: --data (and --eval-data / --eval-fraction) tokenised with the target's chat template,
    once per data + tokenizer + max length, cached on disk and shared by all ranks (dflash.data.token_cache).
    The result is a TokenizedItems; its `.eval` holds the evaluation split (None without one)."""
    from dflash.data.token_cache import load_tokenized

    return load_tokenized(config, target.tokenizer)


def dataset_items(dataset) -> list[dict]:
    """Every item of `dataset` ({"input_ids", "loss_mask"} LongTensor[T]); none at all is a TrainError."""
    items = [dataset[i] for i in range(len(dataset))]
    if not items:
        raise TrainError(f"no usable training sample ({getattr(dataset, 'report', '')}); each needs at "
                         "least 2 x --block-size supervised (assistant) tokens. Check --data and --max-length.")
    return items
