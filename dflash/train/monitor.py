"""What a training run shows while it runs: metrics.jsonl, the log, trackers, evaluations, the report.

After every optimizer step the trainer hands its record to `RunMonitor.step`, which adds
    tokens_per_s   real tokens of all ranks per second, averaged since the last log line
    mfu            model FLOPs utilisation of this GPU (dflash.flops; GPU only)
    gpu_mem_gib    peak GPU memory allocated since the previous step (GPU only)
and, on rank 0, appends it to <out>/metrics.jsonl ("split": "train"), logs every --log-every steps and
sends it to the --report-to trackers. Every --eval-every steps, and at the end of a run with an evaluation
split, it evaluates (dflash.train_eval; every rank takes part) and writes a "split": "eval" record the
same ways. At the end, rank 0 writes the run report (dflash.report: plots and a summary).
The time an evaluation takes is not counted in tokens/s.
"""

from __future__ import annotations

import json
import logging
import time

import torch

from dflash.train.flops import StepFlops, peak_flops
from dflash.train.trackers import open_trackers
from dflash.train.evaluation import evaluate_split, measured_tau

log = logging.getLogger("dflash.train")


class RunMonitor:
    def __init__(self, trainer, eval_items: list[dict]):
        self.trainer, self.eval_items = trainer, eval_items
        cfg, d = trainer.config, trainer.d
        self.config, self.d, self.cuda = cfg, d, d.device.type == "cuda"
        self.metrics_path = cfg.out_dir / "metrics.jsonl"
        self.trackers = open_trackers(cfg.report_to or [], cfg.out_dir, cfg.to_dict(), is_main=d.is_main)
        self.peak = peak_flops(d.device)
        self.flops = StepFlops(trainer.target, trainer.drafter_config) if self.peak else None
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
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps({**record, "split": split}) + "\n")
        self.trackers.log(record, split)

    def step(self, m: dict) -> None:
        """Throughput and memory into `m`, then metrics.jsonl, the log, trackers and a due evaluation."""
        cfg, step = self.config, m["step"]
        self.window_tokens += m["tokens"]
        elapsed = max(time.perf_counter() - self.window_start, 1e-9)
        m["tokens_per_s"] = round(self.window_tokens / elapsed, 1)
        if self.peak:
            m["mfu"] = float(f"{self.window_flops / elapsed / self.peak:.4g}")  # 4 significant digits
        if self.cuda:
            m["gpu_mem_gib"] = round(torch.cuda.max_memory_allocated(self.d.device) / 2**30, 3)
            torch.cuda.reset_peak_memory_stats(self.d.device)
        self._write(m, "train")
        if self.d.is_main and (step % cfg.log_every == 0 or step == self.trainer.total_steps):
            log.info("step %d/%d loss %.4f acc %.3f lr %.2e tok/s %.0f acc/pos %s", step,
                     self.trainer.total_steps, m["loss"], m["acc"], m["lr"], m["tokens_per_s"],
                     " ".join(f"{a:.2f}" for a in m["acc_per_pos"]))
            self._restart_window()
        if self.eval_items and cfg.eval_every and step % cfg.eval_every == 0:
            self.evaluate()

    def evaluate(self) -> dict:
        """One evaluation of the current drafter on the evaluation split (all ranks), recorded on rank 0."""
        t = self.trainer
        start = time.perf_counter()
        m = {"step": t.step, **evaluate_split(self.config, t.drafter, t.target, self.eval_items, self.d,
                                               t.pad_id, t.autocast_dtype)}
        if self.config.eval_tau_prompts and self.d.is_main:
            m.update(measured_tau(self.config, t.drafter, t.target, self.eval_items, t.pad_id,
                                  t.autocast_dtype))
        m["eval_s"] = round(time.perf_counter() - start, 2)
        self._write(m, "eval")
        if self.d.is_main:
            measured = (f" tau {m['tau']:.2f} (replayed {m['tau_replay']:.2f}) on {m['tau_prompts']} prompts"
                        if "tau" in m else "")
            log.info("eval step %d loss %.4f acc %.3f tau_est %.2f%s accept/pos %s", t.step, m["loss"], m["acc"],
                     m["tau_est"], measured, " ".join(f"{a:.2f}" for a in m["accept_per_pos"]))
        self.last_eval = t.step
        self._restart_window()
        return m

    def close(self, stopped: bool) -> None:
        """The final evaluation (a finished run with an evaluation split), trackers closed, the report."""
        try:
            if self.eval_items and not stopped and self.last_eval != self.trainer.step:
                self.evaluate()
        finally:
            self.trackers.close()
        if self.d.is_main and self.metrics_path.exists():
            from dflash.train.run_report import write_report

            try:
                log.info("report %s", write_report(self.config.out_dir))
            except Exception as exc:  # the run's results stand without their plots
                log.warning("could not write the run report: %s (run `dflash report %s` to retry)",
                            exc, self.config.out_dir)
