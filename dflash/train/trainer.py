"""dflash-train: one drafter's training run, from its config to its exported drafter.

Single process:        dflash-train --target DIR --data FILE.jsonl --out runs/x
One process per GPU:   dflash-train --nproc-per-node 8 --target DIR --data FILE.jsonl --out runs/x
Two CPU processes:     dflash-train --nproc-per-node 2 ... --device cpu   (gloo)

One optimizer step = grad_accum micro-batches; each micro-batch is dflash.train.step's forward and backward
(anchors and blocks: dflash.train.blocks). Every counter is in OPTIMIZER steps, and the LR schedule
(dflash.train.schedule) uses the same counter. A micro-batch is global: its sequences (or packs) are split
across ranks, and the loss is normalised by the loss weight summed over all ranks, so N processes compute the
same gradient as one process would on the whole micro-batch. The loop is dflash.train.loop's, the same one
that trains several drafters on one target pass (dflash.train.multi); the drafter's own part is a Lane
(dflash.train.lane).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from dflash import distributed
from dflash.config import TrainConfig
from dflash.config.drafters import write_plan
from dflash.data.batches import load_items
from dflash.errors import SAID_BY_RANK_0, DflashError
from dflash.train.records import checkpoint as ckpt
from dflash.train.parallel import drafter_state, layouts, pipeline
from dflash.train.evaluation import eval_split
from dflash.train.lane import TrainResult
from dflash.train.loop import LoopResult, TrainingLoop
from dflash.train.records.monitor import claimed_run
from dflash.train.precheck import check_before_loading
from dflash.train.records.rundir import RunDir
from dflash.train.setup import attention_impl, compile_layers, load_target
from dflash.train.parallel.taps import union
from dflash.train.signals import StopFlag

log = logging.getLogger("dflash.train")


def train(config: TrainConfig, *, target=None, items: list[dict] | None = None,
          on_step: Callable[[int, dict], None] | None = None, handle_signals: bool = True,
          card_gb_for_tests: float | None = None) -> TrainResult:
    """Train a drafter as `config` says; returns when done, stopped by a signal, or on an error.

    `target` and `items` (dicts with input_ids/loss_mask LongTensor[T]) skip loading them from
    --target / --data. `on_step(step, metrics)` runs after every optimizer step; when it returns True the
    run stops as if it got SIGTERM (checkpoint, then return). The run holds its directory for its whole
    length (dflash.train.records.rundir: a second run into it stops at once; an old run there is refused unless
    --resume or --overwrite). `card_gb_for_tests` stands in a card of that many GB for the memory check
    (dflash.train.precheck.check_memory), which otherwise reads the visible GPU and skips a CPU.
    """
    result = run_drafters(config, {"": config}, target=target, items=items, handle_signals=handle_signals,
                          on_step=(lambda step, records: on_step(step, records[""])) if on_step else None,
                          card_gb_for_tests=card_gb_for_tests)
    if "" in result.results:
        return result.results[""]
    return TrainResult(drafter=None, step=0, stopped_by=result.stopped_by, exit_code=result.exit_code)  # a stage rank


def run_drafters(config: TrainConfig, configs: dict[str, TrainConfig], *, specs: list | None = None, target=None,
                 items: list[dict] | None = None, on_step: Callable[[int, dict], bool] | None = None,
                 handle_signals: bool = True, card_gb_for_tests: float | None = None) -> LoopResult:
    """The life of a run of the drafters `configs` ({name: config}; {"": config} is train()'s one drafter)
    on one pass of `config`'s target and data: its process group and run directory, the checks that cost
    seconds, the target (in pipeline stages where the layout says) and data loaded once, the loop, and the
    errors a user can act on. `specs`: the `drafters` list of a --config file (dflash.train.multi), written
    beside the run."""
    layouts.check_layout(config)  # before any process group or weight
    with drafter_state.of(config.layout).joined(config) as d, claimed_run(config, d) as run:
        stop = StopFlag().install() if handle_signals else StopFlag()
        loop = None
        try:
            for cfg in configs.values():
                attention_impl(cfg, d.device)  # a bad --attention fails before the target loads
            layers = check_before_loading(config, configs, data=items is None, target=target,  # seconds, not minutes
                                          world_size=d.world_size, device=d.device, card_gb_for_tests=card_gb_for_tests)
            tapping = config.replace(target_layer_ids=union(layers)) if not config.model.init_drafter else config
            if config.layout.target_in_stages:  # stage ranks serve the target until the drafter ranks end
                target, d, items = pipeline.place(config, d, lambda: target or load_target(tapping, d.device, cpu=True),
                                                  lambda t: load_items(config, t) if items is None else items, stop)
                if target is None:  # a stage rank, done serving
                    return LoopResult(stopped_by=stop.reason, exit_code=stop.exit_code if stop else 0)
            if target is None:  # tapping every drafter's layers
                target = load_target(tapping, d.device)
            if items is None:
                items = load_items(config, target)
            items, eval_items = eval_split(config, target, items)
            loop = TrainingLoop(configs, target, items, d, stop, on_step, eval_items, layers)
            if config.io.resume:
                loop.restore()
            if d.is_main:  # only once the checkpoint fits: a refused --resume leaves the stored options as they were
                _write_configs(run, config, configs, specs)
            _say_what_trains(loop, configs, len(items), d)
            result = loop.run()
            getattr(target, "close", lambda: None)()  # pipeline: the stage ranks may stop
            return result
        except DflashError as exc:  # also in train.log, where a run's story is read afterwards
            if d.is_main or not isinstance(exc, SAID_BY_RANK_0):  # a refusal: rank 0's line says it for all
                log.error("stopped: %s", exc)
            raise
        except Exception as exc:  # a full disk, a lost rank: the drafters checkpoint at the same steps
            first = RunDir(next(iter(configs.values())).io.out)
            error = known_fault(exc, config, first, d, loop.step if loop else 0)
            if error is None:
                raise
            log.error("stopped: %s", error)  # in train.log too, when it can be written
            raise error from None
        finally:
            stop.uninstall()


def _write_configs(run: RunDir, config: TrainConfig, configs: dict[str, TrainConfig], specs: list | None) -> None:
    """The run's config.json; with a `drafters` list, that list (for --resume) and each drafter's config.json."""
    config.to_json(run.config)
    if specs:
        write_plan(run.root, specs)
        for cfg in configs.values():
            Path(cfg.io.out).mkdir(parents=True, exist_ok=True)
            cfg.to_json(RunDir(cfg.io.out).config)


def _say_what_trains(loop: TrainingLoop, configs: dict[str, TrainConfig], sequences: int, d: distributed.Dist) -> None:
    lane, config = loop.first, loop.config
    what = f"{len(configs)} drafters ({', '.join(configs)}) for " if len(configs) > 1 else ""
    log.info("training %s%d steps on %d sequences%s, world size %d, device %s, %s, %s attention, %s", what,
             loop.total_steps, sequences, ", one target pass" if len(configs) > 1 else "", d.world_size, d.device,
             lane.autocast_dtype, lane.drafter.attention, loop.batching.describe())
    for note in loop.batching.notes(compiled=compile_layers(config, d.device)) if d.is_main else []:
        log.warning("%s", note)


def known_fault(exc: Exception, config: TrainConfig, run: RunDir, d: distributed.Dist, step: int) -> DflashError | None:
    """The error a user can act on for a fault no code below wrapped: a disk that refused a write
    (metrics.jsonl, trackers, the report) or another rank that went away mid-collective; None otherwise."""
    from dflash.train import faults

    if isinstance(exc, OSError) and exc.errno in ckpt.DISK_ERRNOS:
        return ckpt.disk_error(exc, config.io.out, run.checkpoints)
    if d.enabled and faults.is_peer_lost(exc):
        return faults.rank_lost(exc, d.rank, step, ckpt.read_latest(run.checkpoints))
    return None
