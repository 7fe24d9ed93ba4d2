"""RunDir: every path of a run directory (`dflash-train --out DIR`), the lock that keeps one run in it at
a time, and the refusal to start a new run over an old one.

    <out>/config.json        the run's resolved TrainConfig, nested JSON (a valid --config; --resume reads it)
    <out>/train.log          the log (rank 0)
    <out>/metrics.jsonl      one record per optimizer step and per evaluation (dflash.train.records.monitor)
    <out>/checkpoints/       step-NNNNNNNN/ and `latest` (inside a checkpoint: dflash.train.records.checkpoint)
    <out>/drafter/           the final drafter, in the layout vLLM and SGLang serve
    <out>/drafters/NAME/     with several drafters per run (dflash.train.multi): each drafter's own run
                             directory (config.json, metrics.jsonl, checkpoints/, drafter/, report/)
    <out>/report/            plots and report.md (dflash.train.records.run_report)
    <out>/tensorboard/       --report-to tensorboard; wandb/ with --report-to wandb (wandb names it)
    <out>/demo-data.jsonl    the demo's conversations, answered by the demo target
    <out>/eval.json          the demo's final evaluation
    <out>/.run.lock          held by the run writing here; it keeps the holder's pid

(The heartbeat is not in the run directory: $DFLASH_HEARTBEAT, dflash.train.records.heartbeat.)

A run holds the lock on its directory from before its first write to its end (`claim`); under torchrun
rank 0 holds it for all ranks, which share the directory. A second run into the same directory stops at
once (RunDirBusy, exit 10) without writing there. A new run into a directory that holds a run (its
config.json, metrics, checkpoints or drafter) is refused unless it continues it (--resume) or replaces
it (--overwrite: the files above are deleted first; files the run did not write stay).
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import ExitStack, contextmanager
from pathlib import Path

from common.fsutil import exclusive

from dflash.config import TrainConfig, is_run_config
from dflash.errors import ConfigError, DflashError, RunDirBusy

# Paths of this process's held run directories: a run started inside another (the demo trains through
# train()) claims nothing twice.
_HELD: set[str] = set()


class RunDir:
    """The paths of one run directory; nothing is created until the run writes."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, RunDir) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    config = property(lambda self: self.root / "config.json")
    log = property(lambda self: self.root / "train.log")
    metrics = property(lambda self: self.root / "metrics.jsonl")
    checkpoints = property(lambda self: self.root / "checkpoints")
    drafter = property(lambda self: self.root / "drafter")
    drafters = property(lambda self: self.root / "drafters")
    report = property(lambda self: self.root / "report")
    tensorboard = property(lambda self: self.root / "tensorboard")
    wandb = property(lambda self: self.root / "wandb")  # wandb.init(dir=root) writes here
    demo_data = property(lambda self: self.root / "demo-data.jsonl")
    eval_results = property(lambda self: self.root / "eval.json")
    lock = property(lambda self: self.root / ".run.lock")

    def run_files(self) -> list[Path]:
        """What a run wrote here (and the leftovers of one killed while writing), as found now."""
        named = [self.config, self.log, self.metrics, self.checkpoints, self.drafter, self.drafters, self.report,
                 self.tensorboard, self.wandb, self.demo_data, self.eval_results]
        leftovers = [p for pattern in (f".{self.drafter.name}.tmp-*", f".{self.drafter.name}.old-*", ".overwrite-*")
                     for p in sorted(self.root.glob(pattern))]
        return [p for p in named if p.exists()] + leftovers

    def stored_config(self) -> TrainConfig:
        """The config the run stored here (for --resume). Missing or damaged while a checkpoint holds its copy
        (checkpoints/step-N/train_config.json): the message gives the command that puts the copy back."""
        copy = self._checkpoint_config()
        if not self.config.exists():
            if copy is not None:
                raise ConfigError(f"--resume: {self.config} is missing, but checkpoint {copy.parent.name} keeps the "
                                  f"run's config: cp {copy} {self.config}, then run again with --resume.")
            raise ConfigError(f"--resume: {self.config} does not exist, so there is no run to continue in "
                              f"{self.root}. Check --out, or drop --resume to start a new run.")
        try:
            return TrainConfig.from_json(self.config)
        except ConfigError as exc:
            if copy is None:
                raise
            reason = str(exc.__cause__ or exc).split(". ")[0]
            raise ConfigError(f"--resume: {self.config} is damaged ({reason}); checkpoint {copy.parent.name} keeps "
                              f"the run's config: cp {copy} {self.config}, then run again with --resume.") from None

    def _checkpoint_config(self) -> Path | None:
        """The train_config.json of the checkpoint `latest` names (or of the newest one), if it is there."""
        from dflash.train.records.checkpoint import read_latest

        if not self.checkpoints.is_dir():
            return None
        names = [read_latest(self.checkpoints)] + sorted((p.name for p in self.checkpoints.glob("step-*")),
                                                         reverse=True)
        return next((self.checkpoints / n / "train_config.json" for n in names
                     if n and (self.checkpoints / n / "train_config.json").is_file()), None)

    def stored_options(self) -> dict:
        """The stored config's options, flat ({} when there is no config.json)."""
        return self.stored_config().to_flat() if self.config.is_file() else {}

    # --- a run's claim on the directory --------------------------------------------------------------
    def _foreign_config(self) -> bool:
        try:
            return not is_run_config(json.loads(self.config.read_text()))
        except FileNotFoundError:
            return False
        except (OSError, ValueError):
            return True

    def holds_run(self) -> bool:
        """Whether a run lives here: its config.json, metrics, checkpoints or drafter."""
        return any(p.exists() for p in (self.config, self.metrics, self.checkpoints, self.drafter, self.drafters))

    def _describe(self) -> str:
        from dflash.train.records.checkpoint import read_latest

        found = [p.name + ("/" if p.is_dir() else "") for p in (self.config, self.metrics, self.checkpoints,
                                                                 self.drafter, self.drafters) if p.exists()]
        latest = read_latest(self.checkpoints) if self.checkpoints.is_dir() else None
        return ", ".join(found) + (f"; latest checkpoint {latest}" if latest else "")

    def clear(self) -> list[str]:
        """Delete what a run wrote here (run_files); other files stay. Everything is first moved into one
        hidden directory, then that is removed: a crash midway leaves it, and the next clear removes it."""
        found = self.run_files()
        if not found:
            return []
        trash = self.root / f".overwrite-{os.getpid()}"
        try:
            trash.mkdir(exist_ok=True)
            for p in found:
                if p != trash:
                    os.replace(p, trash / p.name)
            shutil.rmtree(trash)
        except OSError as exc:
            raise ConfigError(f"--overwrite: cannot delete the previous run in {self.root}: {exc}. Delete it "
                              "by hand, or give another --out.") from exc
        return [p.name for p in found if not p.name.startswith(".")]

    def prepare(self, *, resume: bool, overwrite: bool) -> list[str]:
        """Refuse a new run over an old one, or clear the old one (--overwrite); returns what was deleted."""
        if self._foreign_config():
            raise ConfigError(f"--out {self.root} holds a config.json that dflash-train did not write (a model "
                              "directory?); give the run a directory of its own with --out.")
        if resume:
            return []
        if overwrite:
            return self.clear()
        if self.holds_run():
            if not self._has_checkpoint():  # --resume would have nothing to continue from
                raise ConfigError(f"--out {self.root} holds the start of a run that stopped before its first "
                                  f"checkpoint ({self._describe()}), so there is nothing to --resume. Start it over "
                                  "with --overwrite (deletes its metrics and log), or give another --out.")
            raise ConfigError(f"--out {self.root} already holds a run ({self._describe()}). Continue it with "
                              "--resume, start over with --overwrite (deletes that run's checkpoints, drafter, "
                              "metrics and log), or give another --out.")
        return []

    def _has_checkpoint(self) -> bool:
        return self.checkpoints.is_dir() and any(self.checkpoints.glob("step-*")) or self.drafter.exists() \
            or self.drafters.exists()

    @contextmanager
    def claim(self, d, *, resume: bool = False, overwrite: bool = False):
        """Hold the directory for a run (rank 0 takes the lock for all ranks of `d`) and `prepare` it;
        yields the names --overwrite deleted. Every rank fails when rank 0 cannot claim it. Inside a
        claim of the same directory by this process (the demo, then its training) it does nothing."""
        from dflash import distributed

        key = str(self.root.resolve())
        if key in _HELD:
            yield []
            return
        with ExitStack() as stack:
            refused, removed = None, []
            if d.is_main:
                try:
                    stack.enter_context(exclusive(self.root, "dflash-train run", lock_name=self.lock.name,
                                                  error=RunDirBusy))
                    removed = self.prepare(resume=resume, overwrite=overwrite)
                except DflashError as exc:
                    refused = exc
                except OSError as exc:  # --out is a file, or not writable
                    refused = ConfigError(f"--out {self.root} cannot hold a run: {exc}. Give a directory "
                                          "this user can write to.")
            if distributed.any_rank(d, refused is not None):
                raise refused or DflashError(f"rank 0 could not start the run in {self.root}; its message says why.")
            _HELD.add(key)
            try:
                yield removed
            finally:
                _HELD.discard(key)


def read_stored_config(out: str) -> TrainConfig:
    """The config stored by the run in `out` (dflash.config.from_args's reader for --resume)."""
    return RunDir(out).stored_config()
