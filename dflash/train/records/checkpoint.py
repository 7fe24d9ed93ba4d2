"""Checkpoints that survive a crash mid-write, and resume that refuses what does not fit.

Layout of the run directory's checkpoints/ (the run directory itself: dflash.train.records.rundir):

    checkpoints/latest             name of the newest complete checkpoint (replaced atomically)
    checkpoints/step-00000300/     one checkpoint
        drafter/                   the drafter in the reference DFlash layout (dflash.io.drafter_dir),
                                   its weights in float32 as trained ("dtype": "float32")
        trainer_state.pt           optimizer, scheduler, RNG, data position, step (tensors and plain
                                   Python values only, so it loads with torch.load(weights_only=True))
        train_config.json          the TrainConfig that wrote it
    <out>/drafter/ (export_drafter) the final drafter: the last checkpoint's, in bf16 (what vLLM and
                                   SGLang serve; --drafter-dtype fp32 keeps float32)

A checkpoint is written into a hidden temp dir (every file fsynced) and renamed into place in one
step; `latest` moves only after that. A failure at any point (disk full, kill -9) leaves the previous
checkpoint and `latest` untouched.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import random
import shutil
from pathlib import Path

import torch

from common.fsutil import atomic_write

from dflash.config import TrainConfig
from dflash.errors import CheckpointError, TrainError
from dflash.io.drafter_dir import load_drafter, save_drafter
from dflash.train.records.manifest import WRITTEN_KEY, write_manifest

log = logging.getLogger("dflash.train")

STATE_FILE = "trainer_state.pt"
FORMAT_VERSION = 1


# --- RNG -------------------------------------------------------------------------------------------
def capture_rng() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    """Set the RNG states `capture_rng` took (moved to the CPU first: torch.set_rng_state takes CPU
    ByteTensors, whatever map_location did when the state was loaded)."""
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


# --- writing ---------------------------------------------------------------------------------------
def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def publish(tmp: Path, final: Path) -> None:
    """Make the complete checkpoint `tmp` visible as `final` and point `latest` at it. The same step
    written twice (a stop right after a resume): the old one is swapped out, then dropped. Its manifest
    (dflash.train.records.manifest) is written first: the last write into it."""
    write_manifest(tmp)
    root, old = final.parent, None
    if final.exists():
        old = root / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
    os.replace(tmp, final)
    atomic_write(root / "latest", final.name + "\n")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(root: Path, *, step: int, drafter, optimizer, scheduler, train_state: dict,
                    config: TrainConfig, keep: int = 2) -> Path:
    """Write checkpoint `root/step-N` atomically, point `root/latest` at it, drop the oldest beyond `keep`.

    `drafter` is the bare Drafter (not the DDP wrapper); `train_state` holds the data position
    (epoch, batch index) and fingerprints, all plain values.
    """
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_drafter(drafter, tmp / "drafter", dtype=None)  # as trained: resume continues exactly
        state = {
            "format": FORMAT_VERSION,
            WRITTEN_KEY: True,  # publish() writes its manifest: --resume then refuses one without it
            "step": step,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": capture_rng(),
            **train_state,
        }
        buffer = io.BytesIO()
        torch.save(state, buffer)
        atomic_write(tmp / STATE_FILE, buffer.getvalue())
        config.to_json(tmp / "train_config.json")
        publish(tmp, final)
    except (OSError, RuntimeError) as exc:  # RuntimeError: torch's and safetensors' writers on a full disk
        raise CheckpointError(
            f"writing checkpoint {final} failed: {type(exc).__name__}: {exc}. The previous checkpoint is intact"
            f" ({read_latest(root) or 'none yet'}). Free disk space or point --out at a larger disk, then "
            "rerun with --resume."
        ) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _prune(root, keep)
    return final


def export_drafter(checkpoint: Path, dest: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a checkpoint's drafter to `dest` with its weights in `dtype` (bf16: what the engines
    serve), replacing an older one only once the new one is complete."""

    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_drafter(load_drafter(checkpoint / "drafter", dtype=torch.float32), tmp, dtype)
    if dest.exists():
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def _prune(root: Path, keep: int) -> None:
    """Drop the oldest checkpoints beyond `keep` (never the one `latest` names), and what a killed run left
    half-written: its hidden temp dirs (a sharded one holds GBs of shards). Called right after a publish, so
    this run has none of its own in flight; the run's lock keeps any other run out of this directory."""
    done = sorted(p for p in root.glob("step-*") if p.is_dir())
    latest = read_latest(root)
    for p in done[:-keep] if keep > 0 else []:
        if p.name != latest:
            shutil.rmtree(p, ignore_errors=True)
    for left in [*root.glob(".tmp-step-*"), *root.glob(".old-step-*")]:
        shutil.rmtree(left, ignore_errors=True)
        log.info("removed %s: a checkpoint write that a killed run did not finish", left)


# --- reading ---------------------------------------------------------------------------------------
def read_latest(root: Path) -> str | None:
    try:
        name = (root / "latest").read_text().strip()
    except FileNotFoundError:
        return None
    return name or None


# A write that fails for one of these reasons fails because of the disk, not because of what was written.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def disk_error(exc: OSError, out, checkpoints: Path) -> TrainError:
    """The TrainError of a run in `out` whose disk refused a write (full, over quota, read-only); the way on
    names the last checkpoint in `checkpoints`."""
    latest = read_latest(checkpoints)
    where = f" ({exc.filename})" if exc.filename else ""
    then = (f"then continue from its last checkpoint ({latest}) with --resume" if latest else
            "then run it again (it had written no checkpoint yet)")
    return TrainError(f"writing the run's files in {out} failed{where}: {exc.strerror or exc}, so the run stopped. "
                      f"Free space on that disk (or point --out at a larger one), {then}.")


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `root/latest` names, or (no `latest` yet: a crash between the rename and it) the
    newest complete one, or None. A `latest` naming a missing or incomplete checkpoint is an error, not
    a silent step back to an older one."""
    name = read_latest(root)
    done = sorted(p for p in root.glob("step-*") if (p / STATE_FILE).exists())
    if name:
        if (root / name / STATE_FILE).exists() and "/" not in name and name not in ("..", "."):
            return root / name
        others = ", ".join(p.name for p in done) or "none"
        raise CheckpointError(
            f"{root / 'latest'} names {name[:80]!r}, which is not a complete checkpoint in {root} (complete: "
            f"{others}). Write the one to resume from into it (e.g. echo {done[-1].name if done else 'step-N'} > "
            f"{root / 'latest'}), or start a new run without --resume.")
    return done[-1] if done else None


def load_weights(checkpoint: Path, load_file, device: str = "cpu") -> dict:
    """The drafter's weights of a checkpoint via safetensors' `load_file`; a damaged file is a
    CheckpointError naming it (safetensors raises its own error type, not OSError)."""
    path = checkpoint / "drafter" / "model.safetensors"
    try:
        return load_file(str(path), device=device)
    except Exception as exc:  # SafetensorError, OSError, a truncated header
        raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {exc}. The file is damaged; delete "
                              f"{checkpoint} and point {checkpoint.parent / 'latest'} at an older checkpoint, "
                              "or start a new run without --resume.") from None


def load_error_text(exc: Exception) -> str:
    """What torch.load's error says, without its advice to load with weights_only=False (never the fix for
    a damaged file: it would execute whatever the file's pickle holds)."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    line = line.split(". ")[0].split("Please ")[0].strip().rstrip(".")  # what was found, not torch's advice
    if len(line) > 120:
        line = line[:117] + "..."
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def load_state(checkpoint: Path, map_location="cpu") -> dict:
    """trainer_state.pt, loaded with weights_only=True (plain values and tensors only, no pickled code)."""
    try:
        state = torch.load(checkpoint / STATE_FILE, map_location=map_location, weights_only=True)
    except Exception as exc:  # a truncated or foreign file: name it and the way out
        raise CheckpointError(f"cannot load {checkpoint / STATE_FILE}: {load_error_text(exc)}. Delete {checkpoint} "
                              "to resume from an older checkpoint, or start a new run without --resume.") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{checkpoint / STATE_FILE} holds {type(state).__name__}, not a trainer state; "
                              "start a new run without --resume.")
    if state.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{checkpoint} has checkpoint format {state.get('format')}, this trainer "
                              f"reads format {FORMAT_VERSION}. Start a new run without --resume.")
    return state


def check_compatible(checkpoint: Path, drafter_config: dict, data_fingerprint: str) -> None:
    """Refuse to resume when the target, the drafter's shape or the training data differ.

    `drafter_config` is DrafterConfig.to_dict() of the drafter this run would build.
    """
    from dflash.io.drafter_dir import read_drafter_config
    from dflash.errors import DrafterError

    try:
        saved = read_drafter_config(checkpoint / "drafter").to_dict()
    except DrafterError as exc:
        raise CheckpointError(f"{checkpoint} cannot be resumed: {exc}. Start a new run without --resume.") from exc
    fp_old, fp_new = saved.get("target_fingerprint"), drafter_config.get("target_fingerprint")
    if fp_old != fp_new:
        raise CheckpointError(
            f"{checkpoint} was trained against a different target (fingerprint {fp_old}; --target now "
            f"gives {fp_new}). A drafter only fits the target it was trained on: pass the same --target, "
            "or start a new run in another --out without --resume."
        )
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, now {drafter_config.get(k)!r}"  # a key of one kind only too
             for k in sorted(set(drafter_config) | set(saved))
             if k != "target_fingerprint" and saved.get(k) != drafter_config.get(k)]
    if diffs:
        raise CheckpointError(
            f"{checkpoint} holds a drafter of a different shape ({'; '.join(diffs)}). Resume with the "
            "options the run started with (they are in <out>/config.json), or start a new run in another "
            "--out without --resume."
        )
    state = load_state(checkpoint)
    if state.get("data_fingerprint") != data_fingerprint:
        raise CheckpointError(
            f"{checkpoint} was trained on different data (fingerprint {state.get('data_fingerprint')}, now "
            f"{data_fingerprint}); the data order could not continue where it stopped. Resume with the "
            "same --data and --max-length, or start a new run without --resume."
        )

