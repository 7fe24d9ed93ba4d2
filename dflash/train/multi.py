"""Several drafters from one pass over the data: one target forward per micro-batch, its tapped states fed
to every drafter.

    dflash-train --config sweep.toml          (a `drafters` list: dflash.config.drafters)

Each drafter is a Lane (dflash.train.lane) of its own config, run directory (<out>/drafters/NAME:
config.json, metrics.jsonl, checkpoints/, drafter/, report/), optimizer, LR schedule, metrics and, under
torchrun, its own DDP or FSDP2 wrapper; the loop that drives them is the one a single drafter trains in
(dflash.train.loop), and the run around it is train()'s (dflash.train.trainer.run_drafters): every drafter's
options checked, their tapped layers (the target pass taps the union: dflash.train.parallel.taps), the memory
they need, the target and data loaded once.
<out> holds the run's config.json and train.log; <out>/drafters/drafters.json lists the drafters for
--resume, which resumes them all from their own latest checkpoints (they must all be at the same step).

Memory: the planner's model (dflash.plan), with the drafters' states added up and one drafter's activations
at a time, refuses before any weight loads a run that would not fit the GPU (dflash.train.precheck.check_memory).
"""

from __future__ import annotations

from collections.abc import Callable

from dflash.config import TrainConfig
from dflash.config.drafters import DrafterSpec, drafter_configs
from dflash.train.loop import LoopResult
from dflash.train.trainer import run_drafters


def train_multi(config: TrainConfig, specs: list[DrafterSpec], *, target=None, items: list[dict] | None = None,
                on_step: Callable[[int, dict], bool] | None = None, handle_signals: bool = True,
                card_gb_for_tests: float | None = None) -> LoopResult:
    """Train the drafters `specs` names on one pass of `config`'s target and data (as train() does one).
    `on_step(step, {name: metrics})` may return True to stop the run as SIGTERM would; `card_gb_for_tests`
    stands in a card of that many GB for the memory check (as train()'s does)."""
    configs = drafter_configs(config, specs)  # every drafter's options checked before anything else
    return run_drafters(config, configs, specs=specs, target=target, items=items, on_step=on_step,
                        handle_signals=handle_signals, card_gb_for_tests=card_gb_for_tests)
