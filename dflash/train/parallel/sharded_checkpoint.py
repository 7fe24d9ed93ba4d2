"""Checkpoints of the sharded layouts (shard, offload, pipeline): torch.distributed.checkpoint (DCP).

    checkpoints/step-00000300/
        dcp/                  the drafter's weights and AdamW state as DCP shards, one file per rank that
                              holds drafter state; DCP reshards on load, so a run saved by 4 ranks
                              resumes on 2 (or 1)
        drafter/              the whole drafter in the reference layout, fp32, gathered to rank 0 (the
                              same as a replicate checkpoint's: export_drafter and the resume checks read it)
        trainer_state.pt      scheduler, RNG, data position, step, "checkpoint_kind": "dcp" (no optimizer:
                              it is in dcp/)
        train_config.json

Every rank that holds drafter state writes into one hidden temp dir on a filesystem all of them see;
rank 0 renames it into place and moves `latest` only after every rank finished (as in
dflash.train.records.checkpoint, whose atomicity, manifest (dflash.train.records.manifest: DCP itself checks nothing, so
a flipped byte inside a shard would resume into another drafter) and pruning this reuses.

A failed save ends the same way on every rank (each learns of the others' failure): disk errors say
"free space", any other cause is named in one line per rank; a peer that went away mid-save is left to
the training loop, which names the lost rank (dflash.train.faults).
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import torch

from common.fsutil import atomic_write

from dflash import distributed
from dflash.errors import CheckpointError
from dflash.train.records import checkpoint as ckpt
from dflash.train import faults
from dflash.train.records.manifest import WRITTEN_KEY

DCP_DIR = "dcp"
KIND_KEY = "checkpoint_kind"


def _checkpoint_exception():
    """DCP's error type: a BaseException, which `except Exception` does not catch."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _options(full: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full)


def full_drafter(drafter: torch.nn.Module, rank: int, group=None):
    """The sharded drafter gathered into a plain fp32 drafter of its kind on the CPU on `rank` 0 of `group`
    (None elsewhere); a collective: every rank that holds a shard calls it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from dflash.kinds import build_drafter

    state = get_model_state_dict(drafter, options=_options(full=True))
    if rank != 0:
        return None
    with torch.device("meta"):  # the drafter's own kind: a DFlash2 drafter has convolutions and a selector
        plain = build_drafter(drafter.config, attention=drafter.attention)
    plain.load_state_dict({k: v.float() for k, v in state.items()}, assign=True)
    return plain


def save(root: Path, *, step: int, drafter, optimizer, scheduler, train_state: dict, config, keep: int,
         d: distributed.Dist) -> Path:
    """Write checkpoint `root/step-N` from every rank of `d` (the drafter's ranks: d.group); returns its
    path on every one of them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from dflash.io.drafter_dir import save_drafter

    rank, group = d.rank, d.group

    def barrier():
        distributed.barrier(d)

    final = root / ckpt.step_dir_name(step)
    tmp = root / f".tmp-{final.name}-dcp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    barrier()
    error = None
    try:
        model_state, optim_state = get_state_dict(drafter, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp / DCP_DIR), process_group=group)
        plain = full_drafter(drafter, rank)
        barrier()  # every rank's shards are on disk: rank 0 records them, then the rename makes them visible
        if rank == 0:
            save_drafter(plain, tmp / "drafter", dtype=None)
            state = {"format": ckpt.FORMAT_VERSION, WRITTEN_KEY: True, "step": step, KIND_KEY: "dcp",
                     "scheduler": scheduler.state_dict(), "rng": ckpt.capture_rng(), **train_state}
            buffer = io.BytesIO()
            torch.save(state, buffer)
            atomic_write(tmp / ckpt.STATE_FILE, buffer.getvalue())
            config.to_json(tmp / "train_config.json")
            ckpt.publish(tmp, final)
            ckpt._prune(root, keep)
    except (Exception, _checkpoint_exception()) as exc:
        if faults.is_peer_lost(exc):  # the training loop names the lost rank; no agreement is possible now
            raise
        error = _save_error(exc, final, rank, root)
    finally:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    if distributed.any_rank(d, error is not None):  # every rank stops, whichever one failed
        raise error or CheckpointError(
            f"writing checkpoint {final} failed on another rank of the run, whose message names the cause. The previous "
            f"checkpoint is intact ({ckpt.read_latest(root) or 'none yet'}); rerun with --resume once it is fixed.")
    return final


def _save_error(exc: BaseException, final: Path, rank: int, root: Path) -> CheckpointError:
    intact = f"The previous checkpoint is intact ({ckpt.read_latest(root) or 'none yet'})"
    if faults.disk_cause(exc) is not None:
        return CheckpointError(
            f"writing checkpoint {final} failed on rank {rank}: {faults.summary(exc)}. {intact}. Free disk space or "
            "point --out at a larger disk that every rank sees, then rerun with --resume.")
    return CheckpointError(f"writing checkpoint {final} failed on rank {rank}: {faults.summary(exc)}. {intact}; "
                           "rerun with --resume once the cause is fixed.")


def load(checkpoint: Path, drafter, optimizer, group=None) -> None:
    """Load dcp/ into the sharded drafter and its optimizer, resharded to this run's ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(drafter, optimizer)
    state = {"model": model_state, "optim": optim_state}
    try:
        dcp.load(state, checkpoint_id=str(checkpoint / DCP_DIR), process_group=group)
    except (Exception, _checkpoint_exception()) as exc:  # a missing or damaged shard: name it and the way out
        if faults.is_peer_lost(exc):
            raise
        raise CheckpointError(f"cannot load the sharded state {checkpoint / DCP_DIR}: {faults.summary(exc)}. Point "
                              f"{checkpoint.parent / 'latest'} at an older checkpoint, or start a new run without "
                              "--resume.") from None
    set_state_dict(drafter, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
