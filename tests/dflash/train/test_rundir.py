"""One run per run directory (dflash.train.records.rundir): every path of a run comes from RunDir; two real
`dflash-train` processes into one --out: the second stops at once (exit 10) and the first's files are its
own; a finished run's directory is refused without --resume or --overwrite; --overwrite starts over (the
old run's files gone, not appended to; other files kept); an older run's flat config.json still resumes;
under torchrun only rank 0 takes the lock."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from common.fsutil import exclusive
from dflash.cli import train_main
from dflash.distributed import Dist
from dflash.errors import ConfigError, RunDirBusy
from dflash.train.records import checkpoint as ckpt
from dflash.train.records.rundir import RunDir
from tests.support.dflash_train_fixtures import read_metrics, save_chat_target, train_args, write_chat_jsonl

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return save_chat_target(root / "target"), write_chat_jsonl(root / "chat.jsonl", n=24)


def _dist(rank: int) -> Dist:
    return Dist(rank=rank, world_size=1, local_rank=0, device=torch.device("cpu"))


def _lock(out: Path):
    return exclusive(out, "dflash-train run", lock_name=RunDir(out).lock.name)


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_every_path_of_a_run_is_under_its_root(tmp_path):
    run = RunDir(tmp_path / "run")
    paths = {run.config, run.log, run.metrics, run.checkpoints, run.drafter, run.report, run.tensorboard, run.wandb,
             run.demo_data, run.eval_results, run.lock}
    assert len(paths) == 11 and all(p.parent == run.root for p in paths)
    assert run.run_files() == [] and not run.holds_run()  # nothing is created before the run writes
    assert not run.root.exists()


def test_a_finished_run_is_refused_and_kept_as_it_was(tiny, tmp_path, capsys):
    target, data = tiny
    out = tmp_path / "run"
    assert train_main(train_args(target, data, out, max_steps=1)) == 0
    before = _files(out)
    assert train_main(train_args(target, data, out, max_steps=2)) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume" in err and "--overwrite" in err
    assert _files(out) == before  # not even train.log was appended to


def test_overwrite_starts_over_and_keeps_other_files(tiny, tmp_path):
    target, data = tiny
    out = tmp_path / "run"
    assert train_main(train_args(target, data, out, max_steps=3, save_every=1)) == 0
    (out / "notes.txt").write_text("mine")
    (out / ".overwrite-1234").mkdir()  # left by an --overwrite that was killed midway
    assert train_main(train_args(target, data, out, max_steps=1) + ["--overwrite"]) == 0
    assert [m["step"] for m in read_metrics(out)] == [1]  # a fresh metrics.jsonl, not appended to
    assert sorted(p.name for p in RunDir(out).checkpoints.iterdir()) == ["latest", "step-00000001"]
    assert (out / "notes.txt").read_text() == "mine" and not (out / ".overwrite-1234").exists()
    log = RunDir(out).log.read_text()
    assert "step 3/3" not in log and "--overwrite: deleted the previous run's config.json" in log
    assert json.loads(RunDir(out).config.read_text())["io"]["overwrite"] is True
    assert train_main(train_args(target, data, out, max_steps=2) + ["--resume"]) == 0  # and it continues
    assert [m["step"] for m in read_metrics(out)] == [1, 2]


def test_an_older_runs_flat_config_json_still_resumes(tiny, tmp_path):
    target, data = tiny
    out = tmp_path / "run"
    assert train_main(train_args(target, data, out, max_steps=1)) == 0
    run = RunDir(out)
    flat = run.stored_config().to_flat()
    del flat["overwrite"]  # older runs had no such option
    run.config.write_text(json.dumps(flat, indent=2))
    assert train_main(["--out", str(out), "--resume", "--max-steps", "2", "--no-progress"]) == 0
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
    assert "io" in json.loads(run.config.read_text())  # rewritten in the nested form


def test_only_rank_0_takes_the_lock(tmp_path):
    """Under torchrun the ranks share --out: rank 0 holds the lock for all of them."""
    run = RunDir(tmp_path / "run")
    with _lock(run.root):  # as if another run held it
        with pytest.raises(RunDirBusy, match="another dflash-train run is using"):
            with run.claim(_dist(0)):
                pass
        with run.claim(_dist(1)) as removed:  # rank 1 neither locks nor clears
            assert removed == []


def test_a_claim_inside_a_claim_of_the_same_dir_is_free(tmp_path):
    """The demo holds --out from its data to its evaluation and trains through train(), which claims again."""
    run = RunDir(tmp_path / "run")
    with run.claim(_dist(0)):
        assert run.lock.read_text().strip() == str(os.getpid())
        with run.claim(_dist(0), overwrite=True) as removed:
            assert removed == []
    with _lock(run.root):  # released at the end
        pass


def test_an_out_that_is_a_file_is_refused_by_name(tmp_path):
    (tmp_path / "out").write_text("not a directory")
    with pytest.raises(ConfigError, match="cannot hold a run.*a directory"):
        with RunDir(tmp_path / "out").claim(_dist(0)):
            pass


def test_overwrite_never_takes_a_directory_that_is_not_a_run(tmp_path):
    run = RunDir(tmp_path / "model")
    run.root.mkdir()
    run.config.write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(ConfigError, match="did not write"):
        run.prepare(resume=False, overwrite=True)
    assert run.config.exists()


# --- two real processes ----------------------------------------------------------------------------
def test_a_second_process_into_the_same_out_is_refused_and_the_first_keeps_its_files(tiny, tmp_path):
    target, data = tiny
    out = tmp_path / "run"
    env = {**os.environ, "DFLASH_HEARTBEAT": str(tmp_path / "heartbeat"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "dflash.cli", "train"]
    first = subprocess.Popen(command + train_args(target, data, out, max_steps=100000), cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (RunDir(out).metrics.exists() and RunDir(out).metrics.read_text().strip()):
            if first.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the first run did not reach a step: {first.communicate()[0][-3000:]}")
            time.sleep(0.2)
        config = RunDir(out).config.read_bytes()
        second = subprocess.run(command + train_args(target, data, out, max_steps=2, seed=1), cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=300)
        assert second.returncode == 10, second.stderr[-3000:]
        assert f"another dflash-train run is using {out}" in second.stderr and f"pid {first.pid}" in second.stderr
        assert "Traceback" not in second.stderr
        assert first.poll() is None  # the first run goes on
        assert RunDir(out).config.read_bytes() == config
    finally:
        first.send_signal(signal.SIGTERM)
        output = first.communicate(timeout=120)[0]
    assert first.returncode == 143, output[-3000:]
    steps = [m["step"] for m in read_metrics(out)]
    assert steps == list(range(1, len(steps) + 1))  # one run's records, each step once, in order
    assert ckpt.read_latest(RunDir(out).checkpoints) == ckpt.step_dir_name(steps[-1])
    assert RunDir(out).stored_config().optim.seed == 0  # the first run's config, not the second's
    log = RunDir(out).log.read_text()
    assert log.count("training 100000 steps") == 1 and "training 2 steps" not in log


# --- each state of a run directory has one way forward, and no advice leads back to the same refusal -------
def test_a_run_stopped_before_its_first_checkpoint_is_pointed_at_overwrite_both_ways(tiny, tmp_path, capsys):
    """A retry without --resume is not sent to --resume, and --resume is not sent back: both say
    --overwrite, which then starts the run."""
    target, data = tiny
    out = tmp_path / "run"
    args = train_args(target, data, out, max_steps=3, save_every=0)
    assert train_main(args + ["--max-steps", "1"]) == 0  # writes config.json, metrics and drafter ...
    shutil.rmtree(RunDir(out).drafter)                     # ... then stands for a run killed before a checkpoint
    shutil.rmtree(RunDir(out).checkpoints)
    capsys.readouterr()
    assert train_main(args) == 2
    again = capsys.readouterr().err
    assert "stopped before its first checkpoint" in again and "--overwrite" in again
    assert "Continue it with --resume" not in again
    assert train_main(args + ["--resume"]) == 3
    resumed = capsys.readouterr().err
    assert "--overwrite instead of --resume" in resumed and "Drop --resume" not in resumed
    assert train_main(args + ["--overwrite"]) == 0


@pytest.mark.parametrize("damage", ["damaged", "missing"])
def test_a_damaged_or_missing_run_config_names_the_checkpoints_copy(tiny, tmp_path, capsys, damage):
    """--resume without a readable config.json names the copy in the latest checkpoint and the command that
    restores it; the command works."""
    target, data = tiny
    out = tmp_path / "run"
    args = train_args(target, data, out, max_steps=2, save_every=1)
    assert train_main(args) == 0
    if damage == "damaged":
        RunDir(out).config.write_text('{"model": {"block_size": 4,')
    else:
        RunDir(out).config.unlink()
    capsys.readouterr()
    assert train_main(args + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Delete it" not in err
    command = err.split("cp ", 1)[1].split(", then")[0]
    source, dest = command.split(" ")
    assert Path(source) == RunDir(out).checkpoints / ckpt.step_dir_name(2) / "train_config.json"
    assert Path(dest) == RunDir(out).config
    shutil.copy(source, dest)
    assert train_main(args + ["--resume", "--max-steps", "3"]) == 0
