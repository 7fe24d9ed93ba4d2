"""A DFlash2 run cut back to a checkpoint resumes to the uninterrupted run (losses and weights, the
selector's included), and a resume as the other drafter kind is refused by its flag before the target loads."""

import shutil

import pytest
import torch

from dflash.cli import train_main
from dflash.train.records import checkpoint as ckpt
from dflash.train.records.rundir import RunDir
from tests.support.bad_input import assert_clear_failure
from tests.support.dflash_train_fixtures import read_metrics, save_chat_target, train_args, write_chat_jsonl


def test_a_dflash2_checkpoint_resumes_to_the_uninterrupted_run(tmp_path, capsys):
    from safetensors.torch import load_file

    target = save_chat_target(tmp_path / "target")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=12)
    straight, split = tmp_path / "straight", tmp_path / "split"
    opts = dict(max_steps=4, save_every=2, drafter_kind="dflash2")
    assert train_main(train_args(target, data, straight, **opts)) == 0
    shutil.copytree(straight, split)  # as if the run had stopped right after its step-2 checkpoint
    shutil.rmtree(RunDir(split).checkpoints / ckpt.step_dir_name(4))
    shutil.rmtree(RunDir(split).drafter)
    (RunDir(split).checkpoints / "latest").write_text(ckpt.step_dir_name(2) + "\n")
    lines = RunDir(split).metrics.read_text().splitlines()
    RunDir(split).metrics.write_text("\n".join(lines[:2]) + "\n")

    assert train_main(train_args(target, data, split, **opts) + ["--resume"]) == 0
    for a, b in zip(read_metrics(straight), read_metrics(split), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    w1 = load_file(str(RunDir(straight).drafter / "model.safetensors"))
    w2 = load_file(str(RunDir(split).drafter / "model.safetensors"))
    assert "candidate_selector.successor_codebook" in w1 and w1.keys() == w2.keys()
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-4, atol=1e-6)

    capsys.readouterr()
    stored = RunDir(split).config.read_bytes()
    other = train_args(target, data, split, **{**opts, "drafter_kind": "dflash"}) + ["--resume"]
    code = train_main(other)
    err = capsys.readouterr().err
    assert_clear_failure(code, 3, err, ["holds a drafter trained with --drafter-kind dflash2;",
                                        "asks for --drafter-kind dflash.", "resume with --drafter-kind dflash2"])
    assert "Loading weights" not in err  # refused by its flag before the target loads
    assert RunDir(split).config.read_bytes() == stored  # the run's own options stay as they were
