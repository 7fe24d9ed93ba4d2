"""Training on packed micro-batches (--packing on) through every path: one process, each layout, several
drafters of both kinds, the evaluation split, two ranks that each pack their own share, and resume."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash.cli import train_config, train_main
from dflash.config.drafters import drafter_out
from dflash.errors import CheckpointError
from dflash.io.drafter_dir import load_drafter
from dflash.kinds.dflash2.dflash2_drafter import DFlash2Drafter
from dflash.train.records.rundir import RunDir
from dflash.train.trainer import train
from tests.support.dflash_train_fixtures import (drop_run_log_handlers, read_metrics, train_args)

PACKED = dict(packing="on", pack_tokens=256, pack_anchors=24)


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_drafter(RunDir(out).drafter, dtype=torch.float32).state_dict()


def test_a_packed_run_counts_real_tokens_and_resumes_to_the_same_drafter(tiny_chat, tmp_path):
    target, data = tiny_chat
    whole = tmp_path / "whole"
    assert train_main(train_args(target, data, whole, max_steps=4, drafter_layers=2, **PACKED)) == 0
    records = [m for m in read_metrics(whole) if m.get("split") == "train"]
    assert len(records) == 4 and all(0 < m["tokens"] <= 256 and m["anchors"] <= 24 for m in records)
    told = RunDir(whole).log.read_text()
    assert "packed rows of 256 tokens with 24 anchors" in told
    assert "--max-tokens, --max-anchors only shape padded batches" in told  # train_args sets both

    parts = tmp_path / "parts"
    first = train_config(train_args(target, data, parts, max_steps=4, drafter_layers=2, **PACKED))
    stopped = train(first, handle_signals=False, on_step=lambda step, m: step == 2)
    assert stopped.step == 2 and stopped.stopped_by == "request"
    drop_run_log_handlers()
    assert train_main(train_args(target, data, parts, max_steps=4, drafter_layers=2, **PACKED) + ["--resume"]) == 0
    for name, w in _weights(whole).items():
        assert torch.equal(w, _weights(parts)[name]), name


def test_resuming_with_the_other_batching_is_refused_by_name(tiny_chat, tmp_path):
    target, data = tiny_chat
    out = tmp_path / "run"
    first = train_config(train_args(target, data, out, max_steps=4, **PACKED))
    train(first, handle_signals=False, on_step=lambda step, m: step == 1)
    drop_run_log_handlers()
    again = train_config(train_args(target, data, out, max_steps=4, packing="off") + ["--resume"])
    with pytest.raises(CheckpointError, match="--packing on --pack-tokens 256"):
        train(again, handle_signals=False)


@pytest.mark.parametrize("layout", ["replicate", "shard", "offload"])
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_every_layout_trains_packed(tiny_chat, tmp_path, layout, kind):
    target, data = tiny_chat
    out = tmp_path / "run"
    assert train_main(train_args(target, data, out, layout=layout, drafter_kind=kind, max_steps=2, save_every=1,
                                 eval_fraction=0.2, eval_every=2, **PACKED)) == 0
    split = {m.get("split") for m in read_metrics(out)}
    assert split == {"train", "eval"}
    assert isinstance(load_drafter(RunDir(out).drafter), DFlash2Drafter) == (kind == "dflash2")


def test_two_drafters_of_both_kinds_train_on_one_packed_target_pass(tiny_chat, tmp_path):
    target, data = tiny_chat
    sweep = tmp_path / "sweep.toml"
    sweep.write_text('[[drafters]]\nname = "one"\n\n[[drafters]]\nname = "two"\ndrafter-kind = "dflash2"\n')
    out = tmp_path / "both"
    assert train_main(train_args(target, data, out, layout="shard", max_steps=2, save_every=1, **PACKED)
                      + ["--config", str(sweep)]) == 0
    for name, second in (("one", False), ("two", True)):
        assert isinstance(load_drafter(RunDir(drafter_out(out, name)).drafter), DFlash2Drafter) == second


@pytest.mark.slow  # two torchrun launches of 2 gloo processes (about 40 s each)
@pytest.mark.parametrize("layout", ["replicate", "pipeline"])
def test_two_ranks_each_train_their_own_pack(tiny_chat, tmp_path, layout):
    target, data = tiny_chat
    out = tmp_path / layout
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_HEARTBEAT": str(tmp_path / "heartbeat")}
    extra = dict(target_stages=1, target_layer_ids="1,2") if layout == "pipeline" else {}
    argv = ["--nproc-per-node", "2", *train_args(target, data, out, layout=layout, max_steps=2, save_every=1,
                                                  **extra, **PACKED)]
    done = subprocess.run([sys.executable, "-m", "dflash.cli", "train", *argv], env=env, capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr[-3000:]
    records = [m for m in read_metrics(out) if m.get("split") == "train"]
    per_rank = 256 if layout == "replicate" else 128  # replicate: two packs a step; pipeline: one drafter rank
    assert len(records) == 2 and all(0 < m["tokens"] <= 2 * per_rank for m in records)
    assert RunDir(out).drafter.is_dir()
