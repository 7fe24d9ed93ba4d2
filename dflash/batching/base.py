"""What a batching is asked: everything about a run that depends on how its micro-batches are made.

A Batching is made once per run from its config (dflash.batching.batching_for) and owned by the training
loop with the run's data. The loop, its lanes, the evaluation, the memory check and the planner ask it:

    order(lengths, world, ...)          the data order: the global micro-batches, epoch after epoch
    take(epoch, indices, items, d, ..)  this rank's share of one of them, collated on the device (RankBatch)
    anchors(rank_batch, config, epoch)  where each drafter's blocks start, and what its FLOP count reads
    context(target, batch)              the target's pass over the batch (a mask, or packed segments)
    eval_rounds(config, items, d, ..)   the evaluation split, made the same way
    n_anchors, fixed_shape              the anchors of every micro-batch and the one shape that compiles,
                                        where the batching fixes them
    worst_shapes(world)                 the per-rank micro-batches the memory model must check
    state() / resumes(state)            what a checkpoint records, and whether a resume may go on from it

`config` in the per-drafter questions (anchors, eval_rounds) is that drafter's own (several drafters share
one batching, each with its own --max-anchors and --seed).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from dflash import distributed
from dflash.batching.shares import Share


@dataclass(frozen=True)
class RankBatch:
    """This rank's part of one global micro-batch, collated on the device."""

    share: Share
    batch: dict  # input_ids, loss_mask, attention_mask [B,T] on the device; packed rows add their "segments"
    anchors: list[torch.Tensor] | None = None  # fixed for every drafter, or None: each drafter samples its own
    counted: list[torch.Tensor] | None = None  # those anchors per sequence, from its start (the FLOP count's)


def on_device(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


class Batching(ABC):
    """One way of making a run's micro-batches (module docstring). A subclass names itself (`name`, what
    logs and checkpoints say) and its --packing value (`flag`), and answers the questions below."""

    name: ClassVar[str]
    flag: ClassVar[str]
    title: ClassVar[str]  # a phrase for the run's first log line
    unit: ClassVar[str]   # what the data order's position counts
    anchors_flag: ClassVar[str] = "--max-anchors"  # the option that bounds a micro-batch's anchors

    def __init__(self, config) -> None:
        self.check(config)
        self.config = config

    @classmethod
    def check(cls, config) -> None:
        """Refuse (ConfigError) options this batching cannot serve, before anything loads (none here)."""
        return None

    # --- the data ----------------------------------------------------------------------------------
    @abstractmethod
    def order(self, lengths: list[int], world: int, epoch: int = 0, index: int = 0):
        """The data order (next() -> (epoch, indices of a global micro-batch); state(); batches_per_epoch)."""

    @abstractmethod
    def take(self, epoch: int, indices, items: list[dict], d: distributed.Dist, pad_id: int) -> RankBatch:
        """This rank's share of the global micro-batch `indices` (dflash.batching.shares), on d.device."""

    def anchors(self, rank_batch: RankBatch, config, epoch: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the anchors drafter `config` trains on, those anchors per sequence as the FLOP count reads them)."""
        return rank_batch.anchors, rank_batch.counted

    @abstractmethod
    def context(self, target, batch: dict) -> torch.Tensor:
        """The target's tapped states for `batch`."""

    @abstractmethod
    def eval_rounds(self, config, items: list[dict], d: distributed.Dist, pad_id: int) -> Iterator[RankBatch]:
        """The evaluation split's global micro-batches, this rank's share of each with its anchors set (the
        same anchors at every evaluation)."""

    # --- shapes ------------------------------------------------------------------------------------
    @property
    def n_anchors(self) -> int | None:
        """The anchor count every micro-batch is brought to (one shape), or None: as many as it has."""
        return None

    @property
    def fixed_shape(self) -> tuple[int, int] | None:
        """[B, T] of every micro-batch when the batching fixes it (one compile), else None."""
        return None

    def query_rows(self) -> int | None:
        """The drafter's query rows in every micro-batch (n_anchors x block size), when fixed."""
        return None if self.n_anchors is None else self.n_anchors * self.config.model.block_size

    @abstractmethod
    def worst_shapes(self, world: int) -> list[tuple[int, int, int]]:
        """The per-rank micro-batches the memory model must check: (sequences, tokens each, anchors each)."""

    @abstractmethod
    def smaller(self, batch: int, anchors: int, world: int) -> str:
        """'<that micro-batch> fits (<the options that give it>)': the planner's hint for a micro-batch of
        `batch` sequences with `anchors` anchors each."""

    @abstractmethod
    def shrink_options(self) -> str:
        """The options that make a micro-batch smaller, with their values (an out-of-memory message's)."""

    # --- what the run says ----------------------------------------------------------------------------
    def describe(self) -> str:
        return self.title

    def notes(self, compiled: bool) -> list[str]:
        """Warnings about options this batching makes costly or ignores (`compiled`: the drafter's layers)."""
        return []

    # --- checkpoints -------------------------------------------------------------------------------
    def state(self) -> dict:
        """What a checkpoint records, so that a resume counts the data order's position the same way."""
        return {"batching": self.name}

    def resumes(self, state: dict) -> bool:
        """Whether a run of this batching may go on from a checkpoint's `state`."""
        return state.get("batching") == self.name

    @classmethod
    def resume_flags(cls, state: dict) -> str:
        """The options that resume from `state` (a checkpoint this batching wrote)."""
        return f"--packing {cls.flag}"
