"""Every drafter kind under the sharded layouts (one process with a process group of one, and a two-process
pipeline), alone and two kinds on one target pass: the run writes
its DCP checkpoints and exports a drafter of its own kind (the gather used to build a DFlash drafter
whatever the kind, so a DFlash2 run crashed at its first checkpoint with "Unexpected key(s) ...
candidate_selector ..."), and the demo evaluates a sharded drafter (it crashed on "mixed torch.Tensor
and DTensor")."""

from __future__ import annotations

import pytest

from dflash.cli import train_main
from dflash.io.drafter_dir import load_drafter
from dflash.model.dflash2 import DFlash2Drafter
from dflash.train import checkpoint as ckpt
from dflash.train.rundir import RunDir
from tests.support.dflash_train_fixtures import save_chat_target, train_args, write_chat_jsonl


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    return save_chat_target(root / "target"), write_chat_jsonl(root / "chat.jsonl", n=20)


@pytest.mark.parametrize("layout", ["shard", "offload"])
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_a_sharded_run_checkpoints_and_exports_a_drafter_of_its_kind(tiny, tmp_path, kind, layout):
    target, data = tiny
    out = tmp_path / "run"
    assert train_main(train_args(target, data, out, drafter_kind=kind, layout=layout, max_steps=2, save_every=1,
                                 drafter_layers=2, target_layer_ids="1,2")) == 0
    last = ckpt.latest_checkpoint(RunDir(out).checkpoints)
    assert last.name == ckpt.step_dir_name(2) and any((last / "dcp").glob("*.distcp"))
    drafter = load_drafter(RunDir(out).drafter)
    assert isinstance(drafter, DFlash2Drafter) == (kind == "dflash2")


@pytest.mark.slow  # the built-in demo (its cached target), 5 steps under --layout shard (about 40 s)
def test_the_demo_evaluates_a_sharded_drafter(tmp_path, capsys):
    out = tmp_path / "demo"
    assert train_main(["--layout", "shard", "--max-steps", "5", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "trained drafter" in printed and "repeat last token" in printed
    assert (RunDir(out).eval_results).is_file()


def test_a_dflash_and_a_dflash2_drafter_on_one_target_pass_under_shard(tiny, tmp_path):
    """[[drafters]] mixing the kinds under --layout shard: each drafter's checkpoint and export are of its kind."""
    target, data = tiny
    sweep = tmp_path / "sweep.toml"
    sweep.write_text('[[drafters]]\nname = "one"\n\n[[drafters]]\nname = "two"\ndrafter-kind = "dflash2"\n')
    out = tmp_path / "both"
    assert train_main(train_args(target, data, out, layout="shard", max_steps=2, save_every=1)
                      + ["--config", str(sweep)]) == 0
    from dflash.config.drafters import drafter_out

    for name, second in (("one", False), ("two", True)):
        assert isinstance(load_drafter(RunDir(drafter_out(out, name)).drafter), DFlash2Drafter) == second


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
