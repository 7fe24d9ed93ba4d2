"""What a training run shows while it runs: metrics.jsonl, the log, trackers, evaluations, the report.

`setup_logging` sends the "dflash" loggers to stderr and, on rank 0, to the run's train.log.

After every optimizer step the trainer hands its record to `RunMonitor.step`, which adds
    tokens_per_s   real tokens of all ranks per second, averaged since the last log line
    mfu            model FLOPs utilisation of this GPU (dflash.train.probes.mfu; GPU only)
    gpu_mem_gib    peak GPU memory allocated since the previous step (GPU only)
and, on rank 0, appends it to <out>/metrics.jsonl ("split": "train"), logs every --log-every steps and
sends it to the --report-to trackers. Every --eval-every steps, and at the end of a run with an evaluation
split, it evaluates (the trainer's dflash.train.evaluation.SplitEvaluator; every rank takes part) and
writes a "split": "eval" record the same ways (none for an evaluation a stop ended). At the end, rank 0
writes the run report (dflash.train.records.run_report: plots and a summary). The time an evaluation takes is
not counted in tokens/s.

Data flows one way: the monitor gets what it needs when the run starts (MonitorPlan, the run directory,
the FLOP counter, the evaluator) and the records as they come; it reads nothing back from the trainer.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from contextlib import contextmanager
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash.distributed import Dist
from dflash.train.probes.mfu import StepFlops, peak_flops
from dflash.train.records.rundir import RunDir
from dflash.train.records.trackers import open_trackers

log = logging.getLogger("dflash.train")


@dataclass(frozen=True)
class MonitorPlan:
    """What the monitor knows of the run before its first step."""

    total_steps: int        # optimizer steps the run will take
    log_every: int          # --log-every
    eval_every: int         # --eval-every (0: only at the end)
    report_to: list[str]    # --report-to
    options: dict           # the run's options, flat (TrainConfig.to_flat): the trackers record them


class _LogFile(logging.FileHandler):
    """train.log. When it cannot be written (a full disk, say), one line on stderr says so, once, instead
    of logging's traceback for every record, and the log goes on on stderr."""

    failed = False

    def _failed(self, exc: BaseException | None) -> None:
        if not self.failed:
            self.failed = True
            sys.stderr.write(f"dflash: cannot write {self.baseFilename} ({getattr(exc, 'strerror', None) or exc}); "
                             "the log goes on on stderr only\n")

    def handleError(self, record: logging.LogRecord) -> None:
        self._failed(sys.exc_info()[1])

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as exc:
            self._failed(exc)

    def close(self) -> None:
        try:
            super().close()
        except OSError as exc:
            self._failed(exc)


@contextmanager
def claimed_run(config, d: Dist):
    """The run directory of `config`, held for the run (RunDir.claim: a second run into it stops at once;
    an old run is refused unless --resume or --overwrite), with its log set up; yields the RunDir."""
    run = RunDir(config.io.out)
    with run.claim(d, resume=config.io.resume, overwrite=config.io.overwrite) as removed:
        setup_logging(run, d.is_main)
        if removed:
            logging.getLogger("dflash.train").info("--overwrite: deleted the previous run's %s in %s",
                                                   ", ".join(removed), run.root)
        yield run


def setup_logging(run: RunDir, is_main: bool) -> None:
    """Log to stderr and to the run's train.log (rank 0 only; other ranks only warn)."""
    logger = logging.getLogger("dflash")
    logger.setLevel(logging.INFO if is_main else logging.WARNING)
    for h in list(logger.handlers):
        if getattr(h, "_dflash", False):
            logger.removeHandler(h)
            h.close()
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    handlers = [logging.StreamHandler()]
    if is_main:
        run.root.mkdir(parents=True, exist_ok=True)
        handlers.append(_LogFile(run.log))
    for h in handlers:
        h.setFormatter(fmt)
        h._dflash = True
        logger.addHandler(h)
    logger.propagate = False


class RunMonitor:
    def __init__(self, plan: MonitorPlan, run: RunDir, d: Dist, *, flops: StepFlops | None = None,
                 evaluate: Callable[[], dict | None] | None = None):
        """`flops` counts a micro-batch's model FLOPs (for MFU, on a GPU); `evaluate()` evaluates the drafter
        being trained on the evaluation split (every rank calls it; it returns None when a stop ended it), None
        when there is no split."""
        self.plan, self.run, self.d, self.evaluator = plan, run, d, evaluate
        self.cuda = d.device.type == "cuda"
        self.trackers = open_trackers(plan.report_to, run, plan.options, is_main=d.is_main)
        self.peak = peak_flops(d.device)
        self.flops = flops if self.peak else None
        self.last_eval = None
        self._restart_window()

    def _restart_window(self) -> None:
        self.window_tokens, self.window_flops, self.window_start = 0, 0.0, time.perf_counter()

    def count(self, items: list[dict], anchors: list[torch.Tensor]) -> None:
        """Model FLOPs of one micro-batch on this rank (for MFU), from host-side data."""
        if self.flops:
            self.window_flops += self.flops(items, anchors)

    def _write(self, record: dict, split: str) -> None:
        if not self.d.is_main:
            return
        try:
            with open(self.run.metrics, "a") as fh:
                fh.write(json.dumps({**record, "split": split}) + "\n")
        except OSError as exc:  # a full disk fails the write or the close, which name no file: name it
            exc.filename = exc.filename or str(self.run.metrics)
            raise
        self.trackers.log(record, split)

    def step(self, m: dict) -> None:
        """Throughput and memory into `m`, then metrics.jsonl, the log, trackers and a due evaluation."""
        plan, step = self.plan, m["step"]
        self.window_tokens += m["tokens"]
        elapsed = max(time.perf_counter() - self.window_start, 1e-9)
        m["tokens_per_s"] = round(self.window_tokens / elapsed, 1)
        if self.peak:
            m["mfu"] = float(f"{self.window_flops / elapsed / self.peak:.4g}")  # 4 significant digits
        if self.cuda:
            m["gpu_mem_gib"] = round(torch.cuda.max_memory_allocated(self.d.device) / 2**30, 3)
            torch.cuda.reset_peak_memory_stats(self.d.device)
        self._write(m, "train")
        if self.d.is_main and (step % plan.log_every == 0 or step == plan.total_steps):
            log.info("step %d/%d loss %.4f acc %.3f lr %.2e tok/s %.0f acc/pos %s", step, plan.total_steps,
                     m["loss"], m["acc"], m["lr"], m["tokens_per_s"], " ".join(f"{a:.2f}" for a in m["acc_per_pos"]))
            self._restart_window()
        if self.evaluator and plan.eval_every and step % plan.eval_every == 0:
            self.evaluate(step)

    def evaluate(self, step: int) -> dict | None:
        """One evaluation of the current drafter on the evaluation split (all ranks), recorded on rank 0;
        None, and no record, when a stop ended it."""
        start = time.perf_counter()
        metrics = self.evaluator()
        if metrics is None:
            return None
        m = {"step": step, **metrics}
        m["eval_s"] = round(time.perf_counter() - start, 2)
        self._write(m, "eval")
        if self.d.is_main:
            measured = (f" tau {m['tau']:.2f} (replayed {m['tau_replay']:.2f}) on {m['tau_prompts']} prompts"
                        if "tau" in m else "")
            log.info("eval step %d loss %.4f acc %.3f%s accept/pos %s", step, m["loss"], m["acc"],
                     measured, " ".join(f"{a:.2f}" for a in m["accept_per_pos"]))
        self.last_eval = step
        self._restart_window()
        return m

    def close(self, step: int, stopped: bool) -> None:
        """The final evaluation (a finished run with an evaluation split), trackers closed, the report."""
        try:
            if self.evaluator and not stopped and self.last_eval != step:
                self.evaluate(step)
        finally:
            self.trackers.close()
        if self.d.is_main and self.run.metrics.exists():
            from dflash.train.records.run_report import write_report

            try:
                log.info("report %s", write_report(self.run.root))
            except Exception as exc:  # the run's results stand without their plots
                log.warning("could not write the run report: %s (run `dflash report %s` to retry)",
                            exc, self.run.root)
