"""The training loop, for one drafter or several on one target pass.

    TrainingLoop(configs, target, items, d, stop)    the run's batching (dflash.batching, chosen once) and
                                                     one Lane (dflash.train.lane) per drafter config
        per micro-batch   the data order's next indices (one order, shared), this rank's share collated once
                          by the batching (a zero-weight stand-in where it has none: dflash.batching.shares),
                          the target's pass once (tapping the union of the drafters' layers:
                          dflash.train.parallel.taps); then for each drafter: its columns of it, its anchors,
                          forward, backward
        per step          each drafter's clip, AdamW and LR step, metrics record, checkpoint (same steps)
        at the end        each drafter's last checkpoint and exported drafter

dflash.train.trainer.train() runs it with one drafter into --out, dflash.train.multi.train_multi() with a
`drafters` list into <out>/drafters/NAME. With several, every drafter keeps its own global RNG stream (the
state right after its init, as a run of it alone has it, swapped in around everything it runs), so no drafter
perturbs another and each ends bit-identical to a run of it alone with the same seed.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable

import torch

from dflash import distributed
from dflash.batching import RankBatch, batching_for
from dflash.config import TrainConfig
from dflash.errors import CheckpointError
from dflash.train.records import checkpoint as ckpt
from dflash.train.records.heartbeat import Heartbeat
from dflash.train.lane import Lane, TrainResult
from dflash.train.signals import StopFlag
from dflash.train.parallel.taps import TargetView

log = logging.getLogger("dflash.train")


@dataclass
class LoopResult:
    results: dict[str, TrainResult] = field(default_factory=dict)  # per drafter name, in the config's order
    step: int = 0
    stopped_by: str | None = None
    exit_code: int = 0


class TrainingLoop:
    """The lanes of 1..K drafters driven from one target pass; `run()` trains them all."""

    def __init__(self, configs: dict[str, TrainConfig], target, items: list[dict], d: distributed.Dist,
                 stop: StopFlag, on_step: Callable[[int, dict], bool] | None = None,
                 eval_items: list[dict] | None = None, layers: dict[str, list[int]] | None = None):
        """`layers`: each drafter's tapped target layers when they are not all the target's (dflash.train.parallel.taps).
        `on_step(step, {name: metrics})` may return True to stop as SIGTERM would."""
        self.target, self.items, self.d, self.stop, self.on_step = target, items, d, stop, on_step
        self.config = next(iter(configs.values()))
        self.batching = batching_for(self.config, d.device)  # the drafters share its micro-batches (config.drafters)
        self.lanes: dict[str, Lane] = {}
        self.rng: dict[str, dict] = {}
        for name, config in configs.items():
            sees = TargetView(target, layers[name]) if layers and layers[name] != list(target.layer_ids) else target
            # seeds the RNG, then inits
            self.lanes[name] = Lane(config, sees, items, d, self.batching, eval_items, stop)
            if len(configs) > 1:
                self.rng[name] = ckpt.capture_rng()  # this drafter's stream, as a run of it alone has it now
        self.first = next(iter(self.lanes.values()))
        self.heartbeat = Heartbeat(every=self.config.runtime.heartbeat_every) if d.is_main else None
        self._share_order()

    def _share_order(self) -> None:
        """One data order for all drafters (their checkpoints store its position); refuse drafters that are
        not at the same place in the data."""
        states = {name: (lane.step, lane.order.state()) for name, lane in self.lanes.items()}
        if len(set(map(repr, states.values()))) > 1:
            where = ", ".join(f"{name} at step {s}" for name, (s, _o) in states.items())
            raise CheckpointError(f"--resume: the drafters' latest checkpoints are not at the same step ({where}); "
                                  "a run stopped between them. Point each drafter's checkpoints/latest at their "
                                  "common step, then --resume again.")
        for lane in self.lanes.values():
            lane.order = self.first.order

    @contextmanager
    def _own_rng(self, name: str):
        """Run with drafter `name`'s global RNG stream and keep where it got to (one drafter: its stream is
        the process's)."""
        if name not in self.rng:
            yield
            return
        ckpt.restore_rng(self.rng[name])
        try:
            yield
        finally:
            self.rng[name] = ckpt.capture_rng()

    def restore(self) -> None:
        for name, lane in self.lanes.items():
            lane.restore()
            if name in self.rng:
                self.rng[name] = ckpt.capture_rng()
        self._share_order()

    @property
    def step(self) -> int:
        return self.first.step

    @property
    def total_steps(self) -> int:
        return self.first.total_steps

    # --- one optimizer step ------------------------------------------------------------------------
    def take(self, epoch: int, indices: list) -> tuple[RankBatch, torch.Tensor]:
        """This rank's share of a global micro-batch, made by the batching (a stand-in when it holds nothing:
        dflash.batching.shares), and the tapped states of every drafter's layers."""
        rank_batch = self.batching.take(epoch, indices, self.items, self.d, self.first.pad_id)
        return rank_batch, self.batching.context(self.target, rank_batch.batch)

    def _optimizer_step(self) -> dict[str, dict]:
        """grad_accum micro-batches, each with one target forward for all drafters; then each drafter's step."""
        accum = self.config.optim.grad_accum
        totals: dict[str, torch.Tensor] = {}
        for k in range(accum):
            epoch, indices = self.first.order.next()
            rank_batch, context = self.take(epoch, indices)
            for name, lane in self.lanes.items():
                with self._own_rng(name):
                    mine = lane.target.select(context) if isinstance(lane.target, TargetView) else context
                    anchors = lane.anchors(rank_batch, epoch)
                    sums = rank_batch.share.counted(lane._micro_step(rank_batch.batch, anchors, sync=k == accum - 1,
                                                                     context=mine).pack())
                totals[name] = sums if name not in totals else totals[name] + sums
            if self.heartbeat:
                self.heartbeat.beat(self.step)
        records = {}
        for name, lane in self.lanes.items():
            with self._own_rng(name):
                records[name] = lane._apply_step(totals[name])
        return records

    def _save(self) -> None:
        for name, lane in self.lanes.items():
            with self._own_rng(name):
                lane.save()

    # --- the loop ----------------------------------------------------------------------------------
    def run(self) -> LoopResult:
        from tqdm.contrib.logging import logging_redirect_tqdm

        # log lines go through tqdm.write so that they do not tear the progress bar
        with logging_redirect_tqdm(loggers=[logging.getLogger("dflash")]):
            result = self._run()
        if self.heartbeat:
            self.heartbeat.finish(self.step)
        if self.d.is_main and len(self.lanes) > 1:
            self._compare()
        result.step = self.step
        result.exit_code = self.stop.exit_code if result.stopped_by else 0
        return result

    def _run(self) -> LoopResult:
        from tqdm.auto import tqdm

        runtime, d, single = self.config.runtime, self.d, len(self.lanes) == 1
        result = LoopResult(results={name: TrainResult(drafter=lane.drafter, step=lane.step)
                                     for name, lane in self.lanes.items()})
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train" if single else f"train x{len(self.lanes)}",
                   unit="step", disable=not (runtime.progress and d.is_main), dynamic_ncols=True)
        for lane in self.lanes.values():
            lane.drafter.train()
        if self.heartbeat:
            self.heartbeat.beat(self.step, force=True)
        while self.step < self.total_steps:
            records = self._optimizer_step()
            for name, m in records.items():
                with self._own_rng(name):  # a due evaluation runs with this drafter's stream too
                    self.lanes[name].monitor.step(m)
                result.results[name].history.append(m)
            bar.update(1)
            if single:
                m = next(iter(records.values()))
                bar.set_postfix(loss=f"{m['loss']:.3f}", acc=f"{m['acc']:.3f}", tok_s=f"{m['tokens_per_s']:.0f}")
            else:
                bar.set_postfix({name: f"{m['loss']:.3f}" for name, m in records.items()})
            if self.on_step and self.on_step(self.step, records):
                self.stop.request("request")
            stopping = self.stop.agreed(d)  # a signal on any rank stops every rank, with its exit code
            if not stopping and runtime.save_every and self.step % runtime.save_every == 0 \
                    and self.step < self.total_steps:
                self._save()
                stopping = self.stop.agreed(d)  # a signal while it was written: that checkpoint is the last
            if stopping:
                result.stopped_by = self.stop.reason
                break
        bar.close()
        for name, lane in self.lanes.items():
            lane_result = result.results[name]
            lane_result.stopped_by = result.stopped_by
            with self._own_rng(name):
                lane._finish(lane_result, self.stop)
        return result

    def _compare(self) -> None:
        from dflash.train.records.run_compare import write_comparison

        root = Path(self.config.io.out).parent.parent  # <out>/drafters/NAME -> <out>
        try:
            log.info("drafters compared in %s", write_comparison(root))
        except Exception as exc:  # the drafters stand without the comparison
            log.warning("could not compare the drafters: %s (run `dflash report %s` to retry)", exc, root)
