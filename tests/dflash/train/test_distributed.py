"""Two CPU processes under torchrun (gloo, DDP) train exactly like one process on the same global batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash import distributed
from dflash.train.records.rundir import RunDir
from tests.support.dflash_train_fixtures import read_metrics, save_chat_target, train_args, write_chat_jsonl

REPO = Path(__file__).resolve().parents[3]


def test_shard_splits_a_global_batch_round_robin():
    def at(rank, world):
        return distributed.Dist(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))

    batch = [10, 11, 12, 13, 14]
    assert distributed.shard(batch, at(0, 2)) == [10, 12, 14]
    assert distributed.shard(batch, at(1, 2)) == [11, 13]
    assert distributed.shard([10], at(1, 2)) == []  # the trainer runs a zero-weight stand-in then
    assert distributed.shard(batch, at(0, 1)) == batch


def test_single_process_needs_no_process_group():
    d = distributed.init("cpu")
    assert (d.rank, d.world_size, d.is_main, d.enabled) == (0, 1, True, False)
    assert distributed.any_rank(d, True) and not distributed.any_rank(d, False)


@pytest.mark.slow  # three interpreter starts with torch + transformers: 30-90 s on a 2-core machine
def test_two_gloo_processes_match_one_process(tmp_path):
    """Same command, `torchrun --nproc-per-node 2` versus a plain process: per-step losses agree to
    float rounding and so do the final weights (batch 5 also exercises an uneven 3 + 2 split)."""
    from safetensors.torch import load_file

    target = save_chat_target(tmp_path / "target")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=20)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_HEARTBEAT": str(tmp_path / "heartbeat")}
    outs = {}
    for procs in (1, 2):
        out = tmp_path / f"procs{procs}"
        argv = train_args(target, data, out, max_steps=3, batch_size=5, grad_accum=2)
        launcher = [sys.executable, "-m", "dflash.cli", "train"] if procs == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}",
             "-m", "dflash.cli", "train"]
        run = subprocess.run(launcher + argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
        outs[procs] = out
    one, two = read_metrics(outs[1]), read_metrics(outs[2])
    assert [m["step"] for m in two] == [1, 2, 3]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["tokens"] == a["tokens"] and b["anchors"] == a["anchors"]
    w1 = load_file(str(RunDir(outs[1]).drafter / "model.safetensors"))
    w2 = load_file(str(RunDir(outs[2]).drafter / "model.safetensors"))
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # one torchrun launch of 2 processes, then an in-process resume
def test_a_two_process_checkpoint_resumes_to_the_uninterrupted_run(tmp_path):
    """Checkpoint and resume across ranks: 2 gloo processes run 4 steps, checkpointing at 2 and 4. A copy
    of that run cut back to its step-2 checkpoint is resumed (here by one process: the data order and the
    anchors follow the global batch, not the world size) and lands on the same losses and weights."""
    import shutil

    from safetensors.torch import load_file

    from dflash.train.records import checkpoint as ckpt
    from dflash.cli import train_main

    target = save_chat_target(tmp_path / "target")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=20)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_HEARTBEAT": str(tmp_path / "heartbeat")}
    two, split = tmp_path / "two", tmp_path / "split"
    opts = dict(max_steps=4, batch_size=4, grad_accum=2, save_every=2)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "-m", "dflash.cli", "train", *train_args(target, data, two, **opts)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert ckpt.read_latest(RunDir(two).checkpoints) == ckpt.step_dir_name(4)

    shutil.copytree(two, split)  # the same run, as if it had stopped right after its step-2 checkpoint
    shutil.rmtree(RunDir(split).checkpoints / ckpt.step_dir_name(4))
    shutil.rmtree(RunDir(split).drafter)
    (RunDir(split).checkpoints / "latest").write_text(ckpt.step_dir_name(2) + "\n")
    lines = RunDir(split).metrics.read_text().splitlines()
    RunDir(split).metrics.write_text("\n".join(lines[:2]) + "\n")

    assert train_main(train_args(target, data, split, **opts) + ["--resume"]) == 0
    straight, resumed = read_metrics(two), read_metrics(split)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["tokens"] == a["tokens"] and b["anchors"] == a["anchors"]
    w1 = load_file(str(RunDir(two).drafter / "model.safetensors"))
    w2 = load_file(str(RunDir(split).drafter / "model.safetensors"))
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-4, atol=1e-6)
