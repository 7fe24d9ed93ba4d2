"""dflash-train and dflash-eval against an FP8 target: a drafter trained on the FP8 checkpoint of the tiny chat
target (written by dflash fp8-write's code) is evaluated against that FP8 target through the real command
lines, with the lossless check on, and against the bf16 target it came from."""

from __future__ import annotations

import json

import pytest

from dflash.cli import eval_main, train_main
from dflash.model.fp8_checkpoint import write_fp8_checkpoint
from dflash.train.records.rundir import RunDir
from tests.support.dflash_train_fixtures import drop_run_log_handlers, save_chat_target, train_args, write_chat_jsonl


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-eval")
    bf16 = save_chat_target(root / "bf16")
    fp8 = root / "fp8"
    write_fp8_checkpoint(bf16, fp8)
    data = write_chat_jsonl(root / "chat.jsonl", n=16)
    assert train_main(train_args(fp8, data, root / "run", max_steps=2)) == 0
    drop_run_log_handlers()
    return bf16, fp8, data, RunDir(root / "run").drafter


@pytest.mark.parametrize("which", ["fp8", "bf16"])
def test_a_drafter_trained_on_an_fp8_target_is_evaluated_against_it(fp8_run, which, capsys):
    bf16, fp8, data, drafter = fp8_run
    code = eval_main(["--target", str(fp8 if which == "fp8" else bf16), "--drafter", str(drafter), "--data", str(data),
                      "--limit", "2", "--max-new-tokens", "6", "--device", "cpu", "--no-baselines", "--json"])
    text = capsys.readouterr()
    assert code == 0, text.err
    assert "Traceback" not in text.err
    row = json.loads(text.out)["drafter"]
    assert row["lossless"] is True and row["tau"] >= 1.0
