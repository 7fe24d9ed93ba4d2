"""Faults of multi-process runs: damaged sharded (DCP) checkpoints, a full disk while they are written, a
rank that goes away, a signal to one rank. Each ends in one message naming the file or the rank, the
documented exit code, its line in train.log, and no traceback.

DCP wraps every rank's error in a CheckpointException, a BaseException whose str() is a traceback per
rank; DCP checks no sums, so the files' sha256 recorded at save time are what catch a changed shard.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.cli import train_main
from dflash.train.records import checkpoint as ckpt
from dflash.train.records.rundir import RunDir
from tests.support.bad_input import assert_clear_failure
from tests.support.dflash_train_fixtures import save_chat_target, train_args, write_chat_jsonl

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


def _rank_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    """The pid of torchrun's worker with RANK=rank (read from /proc: the launcher's children)."""
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children")
    for pid in children.read_text().split() if children.exists() else []:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return int(pid)
    return None


def _signal_rank_mid_run(tmp_path: Path, argv: list[str], rank: int, sig: signal.Signals) -> tuple[Path, int]:
    """Launch 2 gloo processes under torchrun (each rank's output in logs/.../<rank>/stderr.log), send `sig`
    to `rank` once two steps are in metrics.jsonl; returns the log folder (torchrun's own output in
    torchrun.txt there) and torchrun's exit code."""
    out, logs = Path(argv[argv.index("--out") + 1]), tmp_path / "logs"
    logs.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_HEARTBEAT": str(tmp_path / "heartbeat")}
    with open(logs / "torchrun.txt", "w") as own:
        launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                     "--nproc-per-node=2", "--log-dir", str(logs), "--redirects", "3",
                                     "-m", "dflash.cli", "train", *argv],
                                    cwd=REPO, env=env, stdout=own, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (RunDir(out).metrics.exists() and
                                                   len(RunDir(out).metrics.read_text().splitlines()) >= 2):
            time.sleep(0.2)
        victim = _rank_pid(launcher, rank)
        assert victim, f"rank {rank} did not start training in time"
        os.kill(victim, sig)
        return logs, launcher.wait(timeout=180)
    finally:
        if launcher.poll() is None:
            launcher.kill()


def _rank_log(logs: Path, rank: int) -> str:
    return next(logs.rglob(f"{rank}/stderr.log")).read_text()


@pytest.mark.slow  # one torchrun launch of 2 gloo processes, one of them killed mid-run (about 40 s)
def test_a_killed_rank_is_named_by_the_survivor_without_a_traceback(tmp_path):
    target = save_chat_target(tmp_path / "target")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=20)
    out = tmp_path / "run"
    argv = train_args(target, data, out, layout="shard", max_steps=10_000, epochs=0, save_every=0)
    logs, code = _signal_rank_mid_run(tmp_path, argv, 1, signal.SIGKILL)
    assert code != 0
    survivor = _rank_log(logs, 0)
    assert "Traceback" not in survivor, survivor[-4000:]
    assert "rank 0 lost another process of the run at step" in survivor
    assert "stopped: rank 0 lost another process" in RunDir(out).log.read_text()


@pytest.mark.slow  # one torchrun launch of 2 gloo processes (a drafter rank and a target stage), about 40 s
def test_sigterm_to_a_pipeline_stage_rank_stops_the_whole_run_with_a_checkpoint(tmp_path):
    """The stage rank holds no training loop: its signal goes to the drafter rank with the next share, which
    finishes the step, checkpoints and stops; both ranks exit 143 (torchrun reports the run as stopped)."""
    target = save_chat_target(tmp_path / "target")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=20)
    out = tmp_path / "run"
    argv = train_args(target, data, out, layout="pipeline", target_stages=1, max_steps=10_000, epochs=0,
                      save_every=0, target_layer_ids="1,2")
    logs, code = _signal_rank_mid_run(tmp_path, argv, 1, signal.SIGTERM)
    assert code != 0
    drafter_rank, stage_rank = _rank_log(logs, 0), _rank_log(logs, 1)
    for text in (drafter_rank, stage_rank):
        assert "Traceback" not in text, text[-4000:]
    assert "SIGTERM received by target stage rank 1" in drafter_rank
    log = RunDir(out).log.read_text()
    stopped = [line for line in log.splitlines() if "stopped by SIGTERM at step" in line]
    assert stopped, log[-3000:]
    step = int(stopped[0].split("at step ")[1].split(";")[0])
    assert 2 <= step < 10_000
    assert ckpt.latest_checkpoint(RunDir(out).checkpoints).name == ckpt.step_dir_name(step)
    assert "exitcode: 143" in (logs / "torchrun.txt").read_text()  # torchrun's line for the first rank to end


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
