"""Several drafters from one pass over the data: one target forward per micro-batch, its tapped states fed
to every drafter.

    dflash-train --config sweep.toml          (a `drafters` list: dflash.config.drafters)

Each drafter is a Lane (dflash.train.lane) of its own config, run directory (<out>/drafters/NAME:
config.json, metrics.jsonl, checkpoints/, drafter/, report/), optimizer, LR schedule, metrics and, under
torchrun, its own DDP or FSDP2 wrapper; the loop that drives them is the one a single drafter trains in
(dflash.train.loop). This module sets such a run up: every drafter's options checked, their tapped layers
(the target pass taps the union: dflash.train.parallel.taps), the memory they need, the target and data loaded once.
<out> holds the run's config.json and train.log; <out>/drafters/drafters.json lists the drafters for
--resume, which resumes them all from their own latest checkpoints (they must all be at the same step).

Memory: the planner's model (dflash.plan), with the drafters' states added up and one drafter's activations
at a time, refuses before any weight loads a run that would not fit the GPU (`check_memory`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from collections.abc import Callable

import torch

from dflash.config import TrainConfig
from dflash.config.drafters import DrafterSpec, drafter_configs, write_plan
from dflash.data.batches import load_items
from dflash.errors import SAID_BY_RANK_0, DflashError
from dflash.train.parallel import layouts, pipeline
from dflash.train.evaluation import eval_split
from dflash.train.records.monitor import claimed_run
from dflash.train.precheck import check_before_loading, check_resume_checkpoint
from dflash.train.records.rundir import RunDir
from dflash.train.signals import StopFlag
from dflash.train.parallel.taps import tapped_layers, union
from dflash.train.setup import attention_impl, load_target
from dflash.train.loop import LoopResult, TrainingLoop
from dflash.train.trainer import known_fault

log = logging.getLogger("dflash.train")


# --- memory ----------------------------------------------------------------------------------------
def check_memory(config: TrainConfig, configs: dict[str, TrainConfig], layers: dict[str, list[int]],
                 world: int, device: torch.device, card_gb_for_tests: float | None = None) -> None:
    """The planner's memory check (dflash.plan.planner.check_training_fits) for these drafters on one target
    pass: their states add up, one drafter's activations at a time, the largest anchors any of them samples."""
    from dflash.plan.planner import check_training_fits, visible_card_gb
    from dflash.plan.sizes import drafter_shape, target_shape_from_dir
    from dflash.train.setup import packing

    card_gb = card_gb_for_tests if card_gb_for_tests is not None else visible_card_gb(device)
    if card_gb is None or not config.runtime.memory_check or not config.io.target:
        return
    from dflash.model.target import resolve_target

    target = target_shape_from_dir(resolve_target(config.io.target))
    shapes = [drafter_shape(target, layers=cfg.model.drafter_layers, block_size=cfg.model.block_size,
                            tapped=len(layers[name]), sliding_window=cfg.model.sliding_window,
                            kind=cfg.model.drafter_kind) for name, cfg in configs.items()]
    widest = config.replace(max_anchors=max(cfg.model.max_anchors for cfg in configs.values()))
    check_training_fits(widest, world, card_gb, config.runtime.layout, packed=packing(config, device), drafters=shapes)


def _drafter_layers(config: TrainConfig, configs: dict[str, TrainConfig], target) -> dict[str, list[int]]:
    """Each drafter's tapped target layers, checked against the target's config.json (or the `target` given)
    before any weight loads."""
    if target is not None:
        return tapped_layers(configs, target.num_layers, loaded=target.layer_ids)
    from dflash.io.fit import target_shape
    from dflash.train.precheck import check_target_cheaply

    for name, cfg in configs.items():  # a drafter's own layers: in range, and ones the serving engines tap
        if cfg.model.target_layer_ids != config.model.target_layer_ids:
            try:
                check_target_cheaply(cfg)
            except DflashError as exc:
                raise type(exc)(f"drafter '{name}': {exc}") from None
    if config.model.init_drafter:  # its config.json fixes the layers of every drafter
        from dflash.io.drafter_dir import read_drafter_config

        return {name: list(read_drafter_config(config.model.init_drafter).target_layer_ids) for name in configs}
    return tapped_layers(configs, target_shape(config.io.target).num_layers)


def train_multi(config: TrainConfig, specs: list[DrafterSpec], *, target=None, items: list[dict] | None = None,
                on_step: Callable[[int, dict], bool] | None = None, handle_signals: bool = True,
                card_gb_for_tests: float | None = None) -> LoopResult:
    """Train the drafters `specs` names on one pass of `config`'s target and data (as train() does one).
    `on_step(step, {name: metrics})` may return True to stop the run as SIGTERM would; `card_gb_for_tests`
    stands in a card of that many GB for the memory check (as train()'s does)."""
    configs = drafter_configs(config, specs)  # every drafter's options checked before anything else
    layouts.check_layout(config)  # before any process group or weight
    with layouts.joined(config) as d, claimed_run(config, d) as run:
        stop = StopFlag().install() if handle_signals else StopFlag()
        trainer = None
        try:
            for cfg in configs.values():
                attention_impl(cfg, d.device)
            # the run's own checkpoints are its drafters': each is checked below
            check_before_loading(config.replace(resume=False), data=items is None, target=target is None)
            for cfg in configs.values():
                check_resume_checkpoint(cfg)
            layers = _drafter_layers(config, configs, target)
            check_memory(config, configs, layers, d.world_size, d.device, card_gb_for_tests)
            tapping = config.replace(target_layer_ids=union(layers)) if not config.model.init_drafter else config
            if config.layout.target_in_stages:  # the stage ranks tap every drafter's layers and serve them all
                target, d, items = pipeline.place(config, d, lambda: target or load_target(tapping, d.device, cpu=True),
                                                  lambda t: load_items(config, t) if items is None else items, stop)
                if target is None:  # a stage rank, done serving
                    return LoopResult(stopped_by=stop.reason, exit_code=stop.exit_code if stop else 0)
            if target is None:  # tapping every drafter's layers
                target = load_target(tapping, d.device)
            if items is None:
                items = load_items(config, target)
            items, eval_items = eval_split(config, target, items)
            if d.is_main:
                config.to_json(run.config)
                write_plan(run.root, specs)
                for cfg in configs.values():
                    Path(cfg.io.out).mkdir(parents=True, exist_ok=True)
                    cfg.to_json(RunDir(cfg.io.out).config)
            trainer = TrainingLoop(configs, target, items, d, stop, on_step, eval_items, layers)
            if config.io.resume:
                trainer.restore()
            log.info("training %d drafters (%s) for %d steps on %d sequences, one target pass, world size %d, "
                     "device %s", len(configs), ", ".join(configs), trainer.total_steps, len(items), d.world_size,
                     d.device)
            result = trainer.run()
            getattr(target, "close", lambda: None)()  # pipeline: the stage ranks may stop
            return result
        except DflashError as exc:
            if d.is_main or not isinstance(exc, SAID_BY_RANK_0):  # a refusal: rank 0's line says it for all
                log.error("stopped: %s", exc)
            raise
        except Exception as exc:  # a full disk, a lost rank: the drafters checkpoint at the same steps
            first = RunDir(next(iter(configs.values())).io.out)
            error = known_fault(exc, config, first, d, trainer.step if trainer else 0)
            if error is None:
                raise
            log.error("stopped: %s", error)
            raise error from None
        finally:
            stop.uninstall()
