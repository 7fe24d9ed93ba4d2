"""Faults of multi-process runs: damaged sharded (DCP) checkpoints, a full disk while they are written, a
rank that goes away, a signal to one rank. Each ends in one message naming the file or the rank, the
documented exit code, its line in train.log, and no traceback.

DCP wraps every rank's error in a CheckpointException, a BaseException whose str() is a traceback per
rank; DCP checks no sums, so the files' sha256 recorded at save time are what catch a changed shard.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.cli import train_main
from dflash.train.records import checkpoint as ckpt
from dflash.train.records.rundir import RunDir
from tests.support.bad_input import assert_clear_failure
from tests.support.dflash_train_fixtures import save_chat_target, train_args, write_chat_jsonl
from tests.support.torchrun_job import TorchrunJob, wait_for

REPO = Path(__file__).resolve().parents[3]
SHARD = dict(layout="shard", max_steps=3, save_every=2, drafter_layers=2, target_layer_ids="1,2")


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """A finished --layout shard run (a process group of one): DCP checkpoints at steps 2 and 3."""
    root = tmp_path_factory.mktemp("sharded")
    target = save_chat_target(root / "target")
    data = write_chat_jsonl(root / "chat.jsonl", n=20)
    assert train_main(train_args(target, data, root / "run", **SHARD)) == 0
    return {"target": target, "data": data, "run": root / "run"}


def _dcp(out: Path) -> Path:
    return ckpt.latest_checkpoint(RunDir(out).checkpoints) / "dcp"


def flip_bytes_inside_a_shard(out: Path) -> None:
    path = _dcp(out) / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    path.write_bytes(bytes(data))


def remove_a_shard(out: Path) -> None:
    (_dcp(out) / "__0_0.distcp").unlink()


def truncate_the_metadata(out: Path) -> None:
    path = _dcp(out) / ".metadata"
    path.write_bytes(path.read_bytes()[:40])


@pytest.mark.parametrize("damage, words", [
    (flip_bytes_inside_a_shard, ["dcp/__0_0.distcp is damaged (it changed since it was written", "sha256"]),
    (remove_a_shard, ["dcp/__0_0.distcp is damaged (it is missing; the manifest lists it"]),
    (truncate_the_metadata, ["dcp/.metadata is damaged (it holds 40 bytes"]),
])
def test_a_damaged_sharded_checkpoint_is_refused_before_the_target_loads(sharded_run, tmp_path, capsys, damage,
                                                                         words):
    out = tmp_path / "out"
    shutil.copytree(sharded_run["run"], out)
    damage(out)
    code = train_main(train_args(sharded_run["target"], sharded_run["data"], out, **SHARD) + ["--resume"])
    err = capsys.readouterr().err
    assert_clear_failure(code, 3, err, words + ["echo step-00000002 >"])
    assert "Loading weights" not in err  # refused before the target loaded
    assert "stopped:" in RunDir(out).log.read_text()


def test_a_full_disk_during_a_sharded_save_says_free_space(sharded_run, tmp_path, capsys, monkeypatch):
    """The disk fills while DCP writes a shard: DCP's CheckpointException (a BaseException) becomes a
    CheckpointError naming the errno, not a traceback per rank; no half-written checkpoint is left."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    def full(self, path, mode):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(FileSystem, "create_stream", full)
    out = tmp_path / "out"
    code = train_main(train_args(sharded_run["target"], sharded_run["data"], out, **SHARD))
    err = capsys.readouterr().err
    assert_clear_failure(code, 3, err, ["writing checkpoint", "rank 0: OSError", "No space left on device",
                                        "Free disk space"])
    assert "stopped: writing checkpoint" in RunDir(out).log.read_text()
    assert not [p for p in RunDir(out).checkpoints.iterdir() if p.name.startswith(".tmp-")]


def _signal_rank_mid_run(tmp_path: Path, argv: list[str], rank: int, sig: signal.Signals,
                         launcher: bool = False) -> tuple[TorchrunJob, int]:
    """Launch 2 gloo processes (torchrun running tests.support.dflash_rank, or dflash-train --nproc-per-node 2),
    send `sig` to `rank` once two steps are in metrics.jsonl; returns the job and the launcher's exit code."""
    out = Path(argv[argv.index("--out") + 1])
    job = TorchrunJob.start(tmp_path, argv, launcher=launcher)
    try:
        wait_for(lambda: RunDir(out).metrics.exists() and len(RunDir(out).metrics.read_text().splitlines()) >= 2
                 or job.process.poll() is not None, "two training steps", seconds=300)
        victim = job.ranks().get(rank)
        assert victim, f"rank {rank} did not start training in time: {job.output()[-3000:]}"
        os.kill(victim, sig)
        return job, job.wait(180)
    finally:
        job.kill()


@pytest.mark.slow  # one torchrun launch of 2 gloo processes, one of them killed mid-run (about 40 s)
def test_a_killed_rank_is_named_by_the_survivor_without_a_traceback(tmp_path):
    target = save_chat_target(tmp_path / "target")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=20)
    out = tmp_path / "run"
    argv = train_args(target, data, out, layout="shard", max_steps=10_000, epochs=0, save_every=0)
    job, code = _signal_rank_mid_run(tmp_path, argv, 1, signal.SIGKILL)
    assert code != 0
    survivor = job.rank_log(0)
    assert "Traceback" not in survivor, survivor[-4000:]
    assert "rank 0 lost another process of the run at step" in survivor
    assert "stopped: rank 0 lost another process" in RunDir(out).log.read_text()


@pytest.mark.slow  # one torchrun launch of 2 gloo processes (a drafter rank and a target stage), about 40 s each
@pytest.mark.parametrize("signalled", [1, 0], ids=["stage-rank", "drafter-rank"])
def test_sigterm_to_one_rank_of_a_pipeline_stops_the_whole_run_with_a_checkpoint_and_143(tmp_path, signalled):
    """The stage rank holds no training loop: its signal goes to the drafter rank with the next share, which
    finishes the step, checkpoints and stops. The drafter rank's signal goes to the stage with the last
    header (the stage used to exit 0 then: a scheduler read the stopped run's stage as finished). Both ranks
    exit 143 either way."""
    target = save_chat_target(tmp_path / "target")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=20)
    out = tmp_path / "run"
    argv = train_args(target, data, out, layout="pipeline", target_stages=1, max_steps=10_000, epochs=0,
                      save_every=0, target_layer_ids="1,2")
    job, code = _signal_rank_mid_run(tmp_path, argv, signalled, signal.SIGTERM)
    assert code != 0
    drafter_rank, stage_rank = job.rank_log(0), job.rank_log(1)
    for rank, text in enumerate((drafter_rank, stage_rank)):
        assert "Traceback" not in text, text[-4000:]
        assert f"rank {rank}: dflash exit 143" in text, text[-3000:]
    assert job.exits() == {0: 143, 1: 143}, job.output()[-3000:]  # what torchrun (a scheduler) sees
    if signalled == 1:
        assert "SIGTERM received by target stage rank 1" in drafter_rank
    log = RunDir(out).log.read_text()
    stopped = [line for line in log.splitlines() if "stopped by SIGTERM at step" in line]
    assert stopped, log[-3000:]
    step = int(stopped[0].split("at step ")[1].split(";")[0])
    assert 2 <= step < 10_000
    assert ckpt.latest_checkpoint(RunDir(out).checkpoints).name == ckpt.step_dir_name(step)


@pytest.mark.slow  # one launch of 2 gloo processes (about 60 s on a loaded 2-core machine)
def test_sigterm_to_one_rank_ends_every_rank_and_the_launcher_with_143(tmp_path):
    """dflash-train --nproc-per-node 2, SIGTERM to rank 1 mid-run: rank 0, stopped by it at the same step,
    used to exit 0 ("stopped by another rank"), and torchrun's agent then ended it by SIGTERM while it still
    wrote its report. Every rank now takes the signal as its own and exits 143; the launcher too, and it
    names every rank's code."""
    target = save_chat_target(tmp_path / "target")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=20)
    out = tmp_path / "run"
    argv = train_args(target, data, out, layout="shard", max_steps=10_000, epochs=0, save_every=0)
    job, code = _signal_rank_mid_run(tmp_path, argv, 1, signal.SIGTERM, launcher=True)
    text = job.output()
    assert code == 143, text[-3000:]
    assert re.search(r"dflash-train: rank [01] exited with 143 first, then rank [01] with 143", text), text[-3000:]
    assert "Traceback" not in text
    log = RunDir(out).log.read_text()  # rank 0's
    stopped = [line for line in log.splitlines() if "stopped by SIGTERM received by another rank at step" in line]
    assert stopped and "continue with --resume" in stopped[0], log[-3000:]
    step = int(stopped[0].split("at step ")[1].split(";")[0])
    assert ckpt.latest_checkpoint(RunDir(out).checkpoints).name == ckpt.step_dir_name(step)
    assert (RunDir(out).root / "report" / "report.md").is_file()


@pytest.mark.slow  # one launch of 2 gloo processes, refused before the target loads (about 20 s)
def test_two_processes_resuming_a_changed_shard_exit_3_and_say_it_once(sharded_run, tmp_path):
    """The same damage under dflash-train --nproc-per-node 2 (DCP would reshard the one-rank checkpoint to
    two): every rank finds it, rank 0 says it, and the launch ends with the refusal's own code."""
    out = tmp_path / "out"
    shutil.copytree(sharded_run["run"], out)
    flip_bytes_inside_a_shard(out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_HEARTBEAT": str(tmp_path / "heartbeat")}
    argv = ["--nproc-per-node", "2", *train_args(sharded_run["target"], sharded_run["data"], out, **SHARD), "--resume"]
    run = subprocess.run([sys.executable, "-c", "import sys; from dflash.cli import train_main; sys.exit(train_main())",
                          *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    text = run.stdout + run.stderr
    assert_clear_failure(run.returncode, 3, text, ["__0_0.distcp is damaged (it changed since it was written"])
    assert text.count("stopped:") == 1 and text.count("dflash train: error:") == 1, text[-3000:]  # rank 0 only
    assert "Loading weights" not in text


def test_a_flipped_byte_in_a_full_checkpoints_weights_is_refused(tmp_path, sharded_run, capsys):
    """--layout replicate's checkpoint (whole files, one writer): bytes changed inside the drafter's tensor
    data still parse as safetensors; the manifest names the file before the target loads."""
    out = tmp_path / "full"
    args = train_args(sharded_run["target"], sharded_run["data"], out, max_steps=2, save_every=1)
    assert train_main(args) == 0
    weights = ckpt.latest_checkpoint(RunDir(out).checkpoints) / "drafter" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-16:-8] = bytes(b ^ 0x55 for b in data[-16:-8])  # inside the last tensor's values
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    code = train_main(args + ["--resume"])
    err = capsys.readouterr().err
    assert_clear_failure(code, 3, err, ["drafter/model.safetensors is damaged (it changed since it was written",
                                        "echo step-00000001 >"])
    assert "Loading weights" not in err
