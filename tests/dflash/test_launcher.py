"""dflash-train --nproc-per-node N: torchrun's launch in this process, ending with the run's own exit code
(plain torchrun ends every worker failure with its own traceback and exit 1); a refusal found by every
rank is said once, by rank 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash.errors import ConfigError
from dflash.launcher import exit_code_of, split_launch
from dflash.train.records.rundir import RunDir
from tests.support.dflash_train_fixtures import save_chat_target, train_args, write_chat_jsonl

REPO = Path(__file__).resolve().parents[2]


def test_the_process_count_is_taken_out_of_the_training_arguments():
    assert split_launch(["--out", "x", "--nproc-per-node", "4", "--resume"]) == (4, ["--out", "x", "--resume"])
    assert split_launch(["--nproc-per-node=2", "--out", "x"]) == (2, ["--out", "x"])
    assert split_launch(["--out", "x"]) == (None, ["--out", "x"])
    for bad in ("0", "two", "-1"):
        with pytest.raises(ConfigError, match="a whole number of at least 1"):
            split_launch(["--nproc-per-node", bad])


def test_a_worker_killed_by_a_signal_counts_as_the_shell_counts_it():
    assert exit_code_of(SimpleNamespace(exitcode=-9)) == 137
    assert exit_code_of(SimpleNamespace(exitcode=-15)) == 143
    assert exit_code_of(SimpleNamespace(exitcode=3)) == 3


def _dflash_train(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_HEARTBEAT": str(tmp_path / "heartbeat")}
    return subprocess.run([sys.executable, "-c", "import sys; from dflash.cli import train_main; "
                           "sys.exit(train_main())", *argv], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch")
    return save_chat_target(root / "target"), write_chat_jsonl(root / "chat.jsonl", n=20)


@pytest.mark.slow  # two launches of 2 gloo processes (about 60 s on a 2-core machine)
def test_a_refusal_keeps_its_code_and_is_said_once_and_a_good_run_exits_zero(tiny, tmp_path):
    target, data = tiny
    refused = _dflash_train(["--nproc-per-node", "2", *train_args(target, data, tmp_path / "refused",
                                                                  layout="pipeline", target_stages=2)], tmp_path)
    text = refused.stdout + refused.stderr
    assert refused.returncode == 2, text[-3000:]
    assert text.count("--target-stages 2 leaves none of the 2 ranks") == 1, text[-3000:]
    assert "Traceback" not in text and "ChildFailedError" not in text

    out = tmp_path / "run"
    good = _dflash_train(["--nproc-per-node=2", *train_args(target, data, out, layout="shard", max_steps=2)],
                         tmp_path)
    assert good.returncode == 0, (good.stdout + good.stderr)[-3000:]
    assert "world size 2" in RunDir(out).log.read_text()
    assert (RunDir(out).drafter / "model.safetensors").is_file()
