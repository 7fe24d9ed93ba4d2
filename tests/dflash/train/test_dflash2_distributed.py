"""A DFlash2 drafter trains under torchrun (2 gloo processes, DDP) exactly like one process on the same
global batch: its selector, used outside the DDP module's forward (in the loss), is reduced like the rest."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash.train.records.rundir import RunDir
from tests.support.dflash_train_fixtures import read_metrics, save_chat_target, train_args, write_chat_jsonl

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow  # three interpreter starts with torch + transformers: 30-90 s on a 2-core machine
def test_two_gloo_processes_train_a_dflash2_drafter_as_one_process_does(tmp_path):
    from safetensors.torch import load_file

    target = save_chat_target(tmp_path / "target")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=20)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_HEARTBEAT": str(tmp_path / "heartbeat")}
    outs = {}
    for procs in (1, 2):
        out = tmp_path / f"procs{procs}"
        argv = train_args(target, data, out, max_steps=3, batch_size=5, grad_accum=2, drafter_kind="dflash2")
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
    w1 = load_file(str(RunDir(outs[1]).drafter / "model.safetensors"))
    w2 = load_file(str(RunDir(outs[2]).drafter / "model.safetensors"))
    assert any(name.startswith("candidate_selector.") for name in w1)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-4, atol=1e-6)
