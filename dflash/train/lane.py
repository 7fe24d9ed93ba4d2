"""One drafter's part of a training run (dflash.train.loop drives the lanes): its drafter (DDP or FSDP2 as
the layout says), AdamW and LR schedule, its data order's position, its anchors, the forward and backward of
a micro-batch given the tapped states, the optimizer step, checkpoints, resume and the exported drafter.
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dflash import distributed
from dflash.config import TrainConfig
from dflash.batching import Batching, RankBatch, written_by
from dflash.data.batches import data_fingerprint, item_lengths
from dflash.errors import CheckpointError, TrainError
from dflash.train.records import checkpoint as ckpt
from dflash.train.parallel import drafter_state, layouts
from dflash.train.evaluation import SplitEvaluator
from dflash.train.probes.mfu import StepFlops
from dflash.train.records.monitor import MonitorPlan, RunMonitor
from dflash.train.records.rundir import RunDir
from dflash.train.schedule import lr_lambda
from dflash.train.setup import attention_impl, compile_layers, drafter_config, pad_id, precision
from dflash.train.signals import StopFlag
from dflash.train.step import StepSums, backward, micro_batch_sums, oom_message, summarize

log = logging.getLogger("dflash.train")


@dataclass
class TrainResult:
    drafter: torch.nn.Module          # the bare drafter (not the DDP wrapper)
    step: int                         # optimizer steps done
    history: list[dict] = field(default_factory=list)  # one record per optimizer step (rank 0 view)
    checkpoint: Path | None = None
    stopped_by: str | None = None     # "SIGTERM", "SIGINT", "request" or None (ran to the end)
    exit_code: int = 0


class Lane:
    """One drafter's part of a run: its drafter and wrapper, optimizer, schedule, data order, monitor and
    run directory; dflash.train.loop.TrainingLoop drives one lane or several."""

    def __init__(self, config: TrainConfig, target, items: list[dict], d: distributed.Dist, batching: Batching,
                 eval_items: list[dict] | None = None, stop: StopFlag | None = None):
        """`batching`: the run's (the loop's), which makes its data order, its evaluation's micro-batches and its
        checkpoints' record of the order's position; `stop`: the run's StopFlag, which an evaluation on
        `eval_items` heeds between its micro-batches."""
        from dflash.io.drafter_dir import load_drafter
        from dflash.kinds import kind_of

        self.config, self.target, self.items, self.d, self.batching = config, target, items, d, batching
        self.run_dir = RunDir(config.io.out)
        self.pad_id = pad_id(target)
        self.autocast_dtype = precision(config, d.device)
        self.drafter_config = drafter_config(config, target)
        model, optim = config.model, config.optim
        torch.manual_seed(optim.seed)  # the same initial drafter on every rank and on every rerun
        attention = attention_impl(config, d.device, self.drafter_config.head_dim)
        self.kind = kind_of(self.drafter_config)
        self.drafter = self.kind.build(self.drafter_config, attention=attention).to(d.device)
        self.drafter.recompute_layers = config.runtime.recompute_layers
        if model.init_drafter:  # float32 master weights, whatever the file holds
            self.drafter.load_state_dict(load_drafter(model.init_drafter, dtype=torch.float32).state_dict())
        self.layout = config.layout
        self.state = drafter_state.of(self.layout)  # DDP, or FSDP2 sharding the drafter in place
        self.model = self.state.wrap(self.drafter, d, compile=compile_layers(config, d.device))
        self.optimizer = self.state.optimizer(self.drafter, config, d)
        self.fingerprint = data_fingerprint(items)
        self.lengths = item_lengths(items)  # read once: every epoch's and a resume's order is made from them
        self.order = self._data_order()
        self.total_steps = optim.max_steps or optim.epochs * math.ceil(self.order.batches_per_epoch
                                                                       / optim.grad_accum)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(self.total_steps, optim.warmup_ratio))
        self.step = 0
        self.saved: tuple[int, Path | None] | None = None  # (step, path) of the checkpoint this process wrote last
        # metrics.jsonl, log, trackers, evaluation: told what it needs once, then handed each step's record
        evaluate = SplitEvaluator(config, self.drafter, target, eval_items, d, self.pad_id,
                                  self.autocast_dtype, batching, stop) if eval_items else None
        plan = MonitorPlan(total_steps=self.total_steps, log_every=config.runtime.log_every,
                           eval_every=config.watch.eval_every, report_to=config.watch.report_to or [],
                           options=config.to_flat())
        self.monitor = RunMonitor(plan, self.run_dir, d, flops=StepFlops(target, self.drafter_config),
                                  evaluate=evaluate)

    def _data_order(self, epoch: int = 0, index: int = 0):
        return self.batching.order(self.lengths, self.d.world_size, epoch=epoch, index=index)

    # --- resume ------------------------------------------------------------------------------------
    def restore(self) -> Path | None:
        """Load the latest checkpoint of --out (when --resume); refuse one that does not fit."""
        root = self.run_dir.checkpoints
        last = ckpt.latest_checkpoint(root)
        if last is None:
            raise CheckpointError(
                f"--resume: no checkpoint in {root}: the run stopped before its first one, so there is nothing to "
                "continue. Start it over with --overwrite instead of --resume, or give another --out.")
        ckpt.check_compatible(last, self.drafter_config.to_dict(), self.fingerprint)
        state = ckpt.load_state(last, map_location=self.d.device)
        written = written_by(state)
        if not self.batching.resumes({**state, "batching": written.name}):
            was = written.resume_flags(state)
            raise CheckpointError(f"--resume: {last} was written by a run with {was}; its position in the data "
                                  f"counts {written.unit}. Resume with {was}.")
        self.state.restore(last, state, self.drafter, self.optimizer, self.d)
        self.scheduler.load_state_dict(state["scheduler"])
        ckpt.restore_rng(state["rng"])
        self.step = int(state["step"])
        self.order = self._data_order(epoch=int(state["epoch"]), index=int(state["batch_index"]))
        log.info("resumed from %s at step %d (epoch %d, micro-batch %d)", last, self.step,
                 self.order.epoch, self.order.index)
        return last

    def save(self) -> Path | None:
        train_state = {**self.order.state(), "data_fingerprint": self.fingerprint, "world_size": self.d.world_size,
                       "layout": self.layout.name, **self.batching.state()}
        path = self.state.save(self.run_dir.checkpoints, step=self.step, drafter=self.drafter, optimizer=self.optimizer,
                               scheduler=self.scheduler, train_state=train_state, config=self.config, d=self.d)
        if path is not None:
            log.info("checkpoint %s", path)
        distributed.barrier(self.d)
        self.saved = (self.step, path)
        return path

    # --- one micro-batch ---------------------------------------------------------------------------
    def anchors(self, rank_batch: RankBatch, epoch: int) -> list[torch.Tensor]:
        """This drafter's anchors in `rank_batch` (the batching's), counted (a stand-in's: nothing counted)."""
        anchors, counted = self.batching.anchors(rank_batch, self.config, epoch)
        if not rank_batch.share.stand_in:
            self.monitor.count(rank_batch.share.items, counted)
        return anchors

    def _micro_step(self, batch: dict, anchors: list[torch.Tensor], sync: bool,
                    context: torch.Tensor | None = None) -> StepSums:
        """Forward + backward of one micro-batch (gradients accumulate; `context`: see micro_batch_sums)."""
        model = self.config.model
        # DDP reads no_sync in the forward: both passes of an accumulating micro-batch run inside it
        # FSDP2 reduce-scatters every micro-batch: its sharded gradients accumulate, nothing gathered stays
        try:
            with self.model.no_sync() if not sync and isinstance(self.model, DDP) else nullcontext():
                sums = micro_batch_sums(self.model, self.target, batch, anchors, block_size=model.block_size,
                                        gamma=model.gamma, autocast_dtype=self.autocast_dtype, context=context,
                                        objective_options=self.kind.objective_options(model),
                                        n_anchors=self.batching.n_anchors)
                backward(sums, self.d, self.config.optim.grad_accum)
        except torch.OutOfMemoryError as exc:
            raise TrainError(oom_message(self.config, tuple(batch["input_ids"].shape),
                                         sum(int(a.numel()) for a in anchors), self.target.vocab_size,
                                         self.batching.shrink_options())) from exc
        return sums.detached()

    def _apply_step(self, totals: torch.Tensor) -> dict:
        """Clip, AdamW step, LR step on the accumulated gradients; the step's metrics from `totals`."""
        grad_norm = layouts.clip_grad_norm(self.drafter, self.config.optim.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        totals = distributed.all_reduce_sum(self.d, totals)
        # the one read-back of the step: the summed statistics and the (already global) grad norm
        return {"step": self.step, "lr": lr, **summarize(totals, self.config.model.block_size, grad_norm)}

    def _finish(self, result: TrainResult, stop: StopFlag) -> None:
        """The lane's end: last checkpoint, the exported drafter (when not stopped), the monitor closed."""
        # a stop right after a checkpoint (a signal while it was written) ends on it: no second copy of the step
        result.checkpoint = self.saved[1] if self.saved and self.saved[0] == self.step else self.save()
        result.step = self.step
        result.exit_code = stop.exit_code if result.stopped_by else 0
        if result.stopped_by:
            log.warning("stopped by %s at step %d; continue with --resume", stop.describe(), self.step)
        elif self.d.is_main:
            dtype = torch.bfloat16 if self.config.model.drafter_dtype == "bf16" else torch.float32
            ckpt.export_drafter(result.checkpoint, self.run_dir.drafter, dtype)
            log.info("drafter written to %s", self.run_dir.drafter)
        self.monitor.close(self.step, stopped=bool(result.stopped_by))
