"""Evaluation during training: the evaluation split, its loss and per-position acceptance, and tau.

The split: --eval-data FILE (tokenised like --data), or --eval-fraction of the training sequences
(`split_items`: a seeded draw, the same on every rank and every rerun; resume checks the training part's
fingerprint as before).

Every rank takes part in every micro-batch of the split, a zero-weight stand-in where it holds nothing (the
rule training follows: dflash.batching.shares), made by the run's batching as training's are, so the ranks' collectives stay in step under every layout. A
stop (SIGTERM, Ctrl-C, on any rank) ends an evaluation before its next micro-batch on every rank, without a
record; the training loop then writes its checkpoint and stops, as after a step.

What an evaluation reports (dflash.train.step.summarize over the whole split, summed over ranks):
    loss, acc, acc_per_pos     weighted CE and top-1 accuracy per block position k = 1..bs-1
    accept_per_pos             a_k = P(position k correct | positions 1..k-1 correct): of the blocks whose
                               first k-1 guesses match the labels, the share whose k-th matches too
No tau is derived from these rates. A verify step anchored at answer position p yields L(p) = 1 + the
number of leading correct guesses, and 1 + sum_k prod_{j<=k} a_j (the former tau_est) is the mean of L
over the sampled anchors: an arithmetic mean over positions. Decoding anchors each step where the last
one stopped, so its tau = tokens / steps is the harmonic mean, over the tokens it produces, of the L of
the step that produced each (a step of L tokens counts 1/L per token). Two things part them, and neither
is bounded: the kind of mean (arithmetic >= harmonic: decoding dwells on the hard stretches, whose short
steps uniform anchors count once per position), and L at a position inside a step against the step's own
L (a later start may stop at the same hard token, or pass it). Constructed cases put tau above the
uniform mean (every block stops at the next hard token: tau = the gap G, the mean (G + 1) / 2) or near
bs/4 times below it (alternating runs of bs easy and bs hard positions). On the demo (seeds 0-2, 6
evaluations each, 12 prompts) the mean of L over every answer position read x0.85-x1.54 the measured tau
(tau_est x0.97-x1.60 on seeds 0 and 1), its harmonic mean x0.59-x0.90; tau_replay equalled tau in all 18.

With --eval-tau-prompts N, on the first N evaluation sequences (rank 0 only; the other ranks wait at
their next collective):
    tau            measured by speculative decoding (dflash.decode.evaluate) from each sequence's prompt
    tau_replay     greedy verification replayed on the data: a block at every answer position gives
                   L(p) = 1 + leading correct positions; from the answer's first token, p -> p + L(p)
                   for --eval-new-tokens tokens; tau_replay = tokens / steps. With the target's own
                   greedy answers as data it is the same decoding as the measured one, without a
                   target pass per step (demo: 2.467 and 2.467). This is the cheap tau to watch.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import torch

from dflash import distributed
from dflash.batching import Batching
from dflash.config import TrainConfig
from dflash.data.batches import collate
from dflash.train.signals import StopFlag
from dflash.errors import ConfigError
from dflash.train.step import micro_batch_sums, summarize

log = logging.getLogger("dflash.train")


def split_items(items: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(training items, evaluation items): round(fraction x n) items (at least 1) drawn by `seed`,
    the rest kept in their order. fraction 0 gives every item to training."""
    if not fraction:
        return items, []
    n_eval = max(1, round(fraction * len(items)))
    if n_eval >= len(items):
        raise ConfigError(f"--eval-fraction {fraction} of {len(items)} sequences leaves none to train on; "
                          "lower it or give --eval-data.")
    held = set(random.Random(seed).sample(range(len(items)), n_eval))
    return ([it for i, it in enumerate(items) if i not in held], [it for i, it in enumerate(items) if i in held])


def eval_split(config: TrainConfig, target, items: list[dict]) -> tuple[list[dict], list[dict]]:
    """The run's (training items, evaluation items) as --eval-data / --eval-fraction say."""
    if hasattr(items, "eval"):  # dflash.data.token_cache made (and cached) the split while tokenising --data
        return items, list(items.eval or [])
    if config.watch.eval_data:
        from dflash.data.batches import load_items

        eval_items = load_items(config.replace(data=config.watch.eval_data), target)
        return items, eval_items
    return split_items(items, config.watch.eval_fraction, config.optim.seed)


def prompt_of(item: dict) -> list[int]:
    """The tokens before the first supervised (answer) token: the prompt the target answered."""
    supervised = torch.nonzero(item["loss_mask"]).flatten()
    end = int(supervised[0]) if supervised.numel() else len(item["input_ids"])
    return item["input_ids"][:end].tolist()


@torch.no_grad()
def evaluate_split(config: TrainConfig, drafter, target, items: list[dict], d: distributed.Dist,
                   pad_id: int, autocast_dtype: torch.dtype, batching: Batching,
                   stop: StopFlag | None = None) -> dict | None:
    """Loss, accuracy and per-position acceptance of the bare `drafter` on `items` (every rank takes its
    share of each of the batching's micro-batches, Batching.eval_rounds; the sums are added over ranks).
    Before each micro-batch
    the ranks learn whether any has `stop` set (a signal: one all-reduce); then all of them end the
    evaluation there and it returns None, as the training loop ends a run after its step."""
    was_training, model = drafter.training, config.model
    stop = stop if stop is not None else StopFlag()  # a flag no signal sets: it can only learn another rank's
    drafter.eval()
    totals = torch.zeros(4 + 4 * (model.block_size - 1), device=d.device)
    try:
        for n, rank_batch in enumerate(batching.eval_rounds(config, items, d, pad_id)):
            if stop.agreed(d):
                log.warning("evaluation stopped by %s after %d of its micro-batches; no record of it",
                            stop.describe(), n)
                return None
            context = batching.context(target, rank_batch.batch)
            sums = micro_batch_sums(drafter, target, rank_batch.batch, rank_batch.anchors, block_size=model.block_size,
                                    gamma=model.gamma, autocast_dtype=autocast_dtype, context=context,
                                    n_anchors=batching.n_anchors).pack()
            totals += rank_batch.share.counted(sums)
    finally:
        drafter.train(was_training)
    metrics = summarize(distributed.all_reduce_sum(d, totals), model.block_size)
    metrics["sequences"] = len(items)
    return metrics


@torch.no_grad()
def replayed_tau(config: TrainConfig, drafter, target, items: list[dict], pad_id: int,
                 autocast_dtype: torch.dtype) -> float:
    """tau_replay (module docstring) over the first answer of each item."""
    steps = tokens = 0
    was_training = drafter.training
    drafter.eval()
    for item in items:
        mask = item["loss_mask"].bool()
        anchors = torch.nonzero(mask[:-1] & mask[1:]).flatten()
        if not anchors.numel():
            continue
        batch = {k: v.to(target.device) for k, v in collate([item], pad_id).items()}
        correct = micro_batch_sums(drafter, target, batch, [anchors], block_size=config.model.block_size,
                                   gamma=config.model.gamma, autocast_dtype=autocast_dtype,
                                   keep_correct=True).block_correct
        accepted = dict(zip(anchors.tolist(), (1 + correct[0].long().cumprod(-1).sum(-1)).tolist()))
        p, n = int(torch.nonzero(mask).flatten()[0]), 0
        while p in accepted and n < config.demo.eval_new_tokens:
            n, steps, p = n + accepted[p], steps + 1, p + accepted[p]
        tokens += n
    drafter.train(was_training)
    return round(tokens / steps, 4) if steps else 0.0


def measured_tau(config: TrainConfig, drafter, target, items: list[dict], pad_id: int,
                 autocast_dtype: torch.dtype) -> dict:
    """tau by speculative decoding (greedy verification) on the first --eval-tau-prompts prompts."""
    from dflash.decode.evaluate import evaluate

    n_prompts, new_tokens = config.watch.eval_tau_prompts, config.demo.eval_new_tokens
    prompts = [p for p in (prompt_of(it) for it in items[:n_prompts]) if p]
    was_training = drafter.training
    # the fp32 master weights meet a bf16 target as in training: under autocast
    with torch.autocast(target.device.type, dtype=autocast_dtype, enabled=autocast_dtype != torch.float32):
        result = evaluate(target, drafter.eval(), prompts, new_tokens, check_lossless=False)
    drafter.train(was_training)
    return {"tau": round(result["tau"], 4), "tau_prompts": len(prompts), "tau_tokens": result["n_tokens"],
            "tau_replay": replayed_tau(config, drafter, target, items[:n_prompts], pad_id, autocast_dtype)}


@dataclass
class SplitEvaluator:
    """One evaluation of the drafter being trained on the evaluation split: loss and acceptance (every
    rank takes part, micro-batch for micro-batch) and, with --eval-tau-prompts, tau by decoding (rank 0).
    The monitor calls it."""

    config: TrainConfig
    drafter: torch.nn.Module  # the bare drafter (not the DDP wrapper)
    target: object
    items: list[dict]
    d: distributed.Dist
    pad_id: int
    autocast_dtype: torch.dtype
    batching: Batching  # the run's: the split in its micro-batches
    stop: StopFlag | None = None  # the run's: set (a signal) on any rank, the evaluation ends on every rank

    def __call__(self) -> dict | None:
        """The evaluation's metrics, or None when a stop ended it (evaluate_split)."""
        args = (self.config, self.drafter, self.target, self.items)
        m = evaluate_split(*args, self.d, self.pad_id, self.autocast_dtype, self.batching, self.stop)
        if m is not None and self.config.watch.eval_tau_prompts and self.d.is_main:
            m.update(measured_tau(*args, self.pad_id, self.autocast_dtype))
        return m
