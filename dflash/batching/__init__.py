"""How a run's micro-batches are made, chosen once: the registry of batchings and what `--packing` takes.

Each batching (dflash.batching.base.Batching: what every one is asked) is one class in its own module:
padded.py (length-bucketed padded batches, the CPU's default) and packed.py (whole sequences back to back in
rows of one shape, the GPU's default). `batching_for(config, device)` makes the run's one; the training
loop owns it with the run's data, and the loop's lanes, the evaluation, the memory check and the planner
ask it. Nothing else asks which batching a run uses. A new batching is one class and one line in BATCHINGS.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash.batching.base import Batching, RankBatch
from dflash.batching.packed import Packed
from dflash.batching.padded import Padded
from dflash.errors import ConfigError

__all__ = ["BATCHINGS", "CHOICES", "Batching", "RankBatch", "batching_for", "check_named", "named", "written_by"]

BATCHINGS: dict[str, type[Batching]] = {cls.flag: cls for cls in (Padded, Packed)}  # by its --packing value
AUTO = {"cuda": Packed.flag}  # --packing auto by device type; any other device: Padded


class _Choices(Sequence):
    """What --packing takes: 'auto' and every registered batching's flag, read when asked (a batching
    registered later, as a test does, is a choice at once)."""

    def _all(self) -> tuple[str, ...]:
        return ("auto", *BATCHINGS)

    def __getitem__(self, i):
        return self._all()[i]

    def __len__(self) -> int:
        return len(self._all())


CHOICES = _Choices()


def named(flag: str) -> type[Batching]:
    """The batching `--packing flag` asks for ('auto' is resolved by batching_for), or a ConfigError."""
    if flag not in BATCHINGS:
        raise ConfigError(f"--packing is '{flag}'; choose one of {', '.join(CHOICES)}.")
    return BATCHINGS[flag]


def check_named(config) -> None:
    """Refuse, as the config is made, options that the batching --packing names cannot serve ('auto' is
    checked once the device is known, by batching_for)."""
    if config.optim.packing != "auto":
        named(config.optim.packing).check(config)


def batching_for(config, device: torch.device) -> Batching:
    """The run's batching: --packing's, 'auto' resolved for `device` (packed rows on a GPU: fixed shapes, one
    compile, the same memory every step; padded batches elsewhere). Refuses options it cannot serve."""
    flag = config.optim.packing
    if flag == "auto":
        flag = AUTO.get(torch.device(device).type, Padded.flag)
    return named(flag)(config)


def written_by(state: dict) -> type[Batching]:
    """The batching whose checkpoint `state` (its train_state) this is; a checkpoint from before the batching
    was recorded by name says it by its pack size (0: padded)."""
    name = state.get("batching") or (Packed.name if int(state.get("pack_tokens", 0)) else Padded.name)
    for cls in BATCHINGS.values():
        if cls.name == name:
            return cls
    raise ConfigError(f"the checkpoint was written with the batching '{name}', which this version does not have "
                      f"(it has {', '.join(cls.name for cls in BATCHINGS.values())})")
