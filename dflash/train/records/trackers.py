"""Experiment trackers of `dflash-train --report-to`: TensorBoard, Weights & Biases, Trackio.

    --report-to tensorboard            event files in <out>/tensorboard (tensorboard --logdir <out>)
    --report-to wandb                  a W&B run named after --out (optional extra: pip install wandb)
    --report-to trackio                a local Trackio project (optional extra: pip install trackio)
    --report-to tensorboard wandb      several at once; none (the default) for no tracker

Only rank 0 opens trackers (`open_trackers(..., is_main=False)` gives an empty set). A record is logged
as scalars named <split>/<key>; list values (per-position metrics) become <split>/<key>/<k>, with k the
block position 1..bs-1. metrics.jsonl holds the same records whatever trackers are chosen.
"""

from __future__ import annotations

import importlib
import math

from dflash.config import check_report_to
from dflash.errors import ConfigError
from dflash.train.records.rundir import RunDir

# Where each tracker comes from: its import name and the install command a missing one prints.
_PACKAGES = {"tensorboard": ("tensorboard", "pip install tensorboard"),
             "wandb": ("wandb", "pip install wandb"), "trackio": ("trackio", "pip install trackio")}


def scalars(record: dict, split: str) -> dict[str, float]:
    """{"<split>/<key>": value} for the numbers of a metrics record (lists: one scalar per position)."""
    out = {}
    for key, value in record.items():
        if key in ("step", "split") or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            if math.isfinite(value):
                out[f"{split}/{key}"] = float(value)
        elif isinstance(value, list):
            for k, v in enumerate(value, start=1):
                if isinstance(v, (int, float)) and math.isfinite(v):
                    out[f"{split}/{key}/{k}"] = float(v)
    return out


def _import(name: str):
    module, install = _PACKAGES[name]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"--report-to {name} needs the '{module}' package, which is not installed "
                          f"({exc}). Install it with `{install}`, or drop {name} from --report-to.") from exc


class TensorBoardTracker:
    def __init__(self, run: RunDir, config: dict):
        _import("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = run.tensorboard
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in sorted(config.items())), 0)

    def log(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run: RunDir, config: dict):
        wandb = _import("wandb")
        self.run = wandb.init(name=run.root.name, dir=str(run.wandb.parent), config=config)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    def __init__(self, run: RunDir, config: dict):
        self.trackio = _import("trackio")
        self.trackio.init(project="dflash", name=run.root.name, config=config)

    def log(self, values: dict[str, float], step: int) -> None:
        self.trackio.log(values, step=step)

    def close(self) -> None:
        self.trackio.finish()


_CLASSES = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "trackio": TrackioTracker}


class Trackers:
    """Every tracker of a run behind one log/close; an empty set does nothing."""

    def __init__(self, trackers: list):
        self.trackers = trackers

    def log(self, record: dict, split: str) -> None:
        values = scalars(record, split)
        for tracker in self.trackers:
            tracker.log(values, int(record["step"]))

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def open_trackers(names: list[str], run: RunDir, config: dict, *, is_main: bool = True) -> Trackers:
    """The trackers named by --report-to for the run in `run`, opened on rank 0 (other ranks get an empty
    set); `config` is the run's options, flat, which the trackers record."""
    chosen = check_report_to(names)
    if not is_main:
        return Trackers([])
    opened = []
    try:
        for name in chosen:
            opened.append(_CLASSES[name](run, config))
    except BaseException:
        Trackers(opened).close()
        raise
    return Trackers(opened)
