"""A DFlash2 drafter under a two-process pipeline writes its checkpoints and exports a drafter of its kind (the
gather used to build a DFlash drafter whatever the kind, so a DFlash2 run crashed at its first checkpoint with
"Unexpected key(s) ... candidate_selector ..."). The one-process sharded layouts, two kinds on one target pass
and the demo under --layout shard are rows of tests/dflash/test_bad_input_dflash.py; every kind under every
layout, at two world sizes, is tests/dflash/train/test_matrix.py."""

from __future__ import annotations

import pytest

from dflash.io.drafter_dir import load_drafter
from dflash.kinds.dflash2.dflash2_drafter import DFlash2Drafter
from dflash.train.records.rundir import RunDir
from tests.support.dflash_train_fixtures import save_chat_target, train_args, write_chat_jsonl


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    return save_chat_target(root / "target"), write_chat_jsonl(root / "chat.jsonl", n=20)


@pytest.mark.slow  # one torchrun launch of 2 gloo processes: a drafter rank and a target stage (about 40 s)
def test_a_dflash2_drafter_under_pipeline_checkpoints_and_exports(tiny, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    target, data = tiny
    out = tmp_path / "pipeline"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_HEARTBEAT": str(tmp_path / "heartbeat")}
    argv = ["--nproc-per-node", "2", *train_args(target, data, out, drafter_kind="dflash2", layout="pipeline",
                                                  target_stages=1, max_steps=2, save_every=1,
                                                  target_layer_ids="1,2")]
    run = subprocess.run([sys.executable, "-c", "import sys; from dflash.cli import train_main; sys.exit(train_main())",
                          *argv], cwd=Path(__file__).resolve().parents[3], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert isinstance(load_drafter(RunDir(out).drafter), DFlash2Drafter)
