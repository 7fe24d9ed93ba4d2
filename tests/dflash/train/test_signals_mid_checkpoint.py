"""A whole sharded job (--layout shard, 2 gloo processes) signalled while it writes its DCP checkpoint: every
rank, or the launcher's process group, by SIGTERM or SIGKILL.

The write is held open after each rank has opened its first shard file of step 4 (tests.support.dflash_rank,
as a slow filesystem holds it), and the signal is sent then: it lands inside the write every time. Afterwards
`latest` names a complete checkpoint (step 4 when the write could finish, step 2 when it was killed; a
half-written step directory is never taken for one), --resume continues from it, and the resumed run lands
on the run that was never interrupted.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from dflash.cli import train_main
from dflash.train.records import checkpoint as ckpt
from dflash.train.records.rundir import RunDir
from tests.support.dflash_train_fixtures import (assert_same_run, drop_run_log_handlers, read_metrics,
                                                 save_chat_target, train_args, write_chat_jsonl)
from tests.support.torchrun_job import TorchrunJob, alive, wait_for

OPTS = dict(max_steps=6, save_every=2, batch_size=5, grad_accum=2, drafter_layers=2, drafter_dtype="fp32",
            target_layer_ids="1,2")
HELD_STEP = 4


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The tiny target, its data and the run the interrupted ones must land on (one plain process; a
    --layout shard run of 2 processes trains the same: test_layouts.py)."""
    root = tmp_path_factory.mktemp("mid-checkpoint")
    target = save_chat_target(root / "target")
    data = write_chat_jsonl(root / "chat.jsonl", n=20)
    assert train_main(train_args(target, data, root / "one", **OPTS)) == 0
    drop_run_log_handlers()
    return root / "one", target, data


def _held_job(tmp_path: Path, argv: list[str], **launch) -> tuple[TorchrunJob, Path]:
    """The job started, and returned once both ranks hold their first shard file of step HELD_STEP open."""
    held = tmp_path / "held"
    held.mkdir()
    job = TorchrunJob.start(tmp_path, argv, env={"HELD_DCP_STEP": str(HELD_STEP), "HELD_DCP_DIR": str(held)},
                            **launch)
    try:
        wait_for(lambda: len(list(held.glob("rank-*"))) == 2 or job.process.poll() is not None,
                 "both ranks reaching the step-4 checkpoint", seconds=400)
        assert job.process.poll() is None, job.output()[-3000:]
        assert len(job.ranks()) == 2
    except BaseException:
        job.kill()
        raise
    return job, held


def _resume_and_compare(tmp_path: Path, argv: list[str], reference: Path, resumed_from: str) -> None:
    """--resume under torchrun; the run then holds each step's last record (as dflash report counts a step
    recorded twice) and is the uninterrupted run."""
    out = Path(argv[argv.index("--out") + 1])
    (tmp_path / "resume").mkdir()
    job = TorchrunJob.start(tmp_path / "resume", argv + ["--resume"])
    try:
        assert job.wait(400) == 0, job.output()[-3000:]
    finally:
        job.kill()
    assert f"resumed from {RunDir(out).checkpoints / resumed_from}" in RunDir(out).log.read_text()
    assert not [p.name for p in RunDir(out).checkpoints.iterdir() if p.name.startswith(".")]
    last = {m["step"]: m for m in read_metrics(out)}
    RunDir(out).metrics.write_text("".join(json.dumps(last[s]) + "\n" for s in sorted(last)))
    assert_same_run(reference, out)


def _say_stopped(out: Path, step: int) -> None:
    checkpoints = RunDir(out).checkpoints
    assert ckpt.read_latest(checkpoints) == ckpt.step_dir_name(step)
    assert ckpt.latest_checkpoint(checkpoints) == checkpoints / ckpt.step_dir_name(step)
    assert not [p.name for p in checkpoints.iterdir() if p.name.startswith(".")]  # nothing half-written
    assert [m["step"] for m in read_metrics(out)] == list(range(1, step + 1))  # no step after the checkpoint


@pytest.mark.slow  # 2 torchrun launches of 2 gloo processes (about 2 min on a loaded 2-core machine)
def test_sigterm_to_every_rank_mid_write_ends_on_that_checkpoint_and_resumes_into_the_same_run(uninterrupted,
                                                                                               tmp_path):
    """The write finishes, and is the run's last checkpoint (no further step, no second write of the step);
    every rank exits 143 with the message that names --resume."""
    reference, target, data = uninterrupted
    out = tmp_path / "run"
    argv = train_args(target, data, out, layout="shard", **OPTS)
    job, held = _held_job(tmp_path, argv)
    try:
        for pid in job.ranks().values():
            os.kill(pid, signal.SIGTERM)
        (held / "release").write_text("")
        assert job.wait() != 0
    finally:
        job.kill()
    assert job.exits() == {0: 143, 1: 143}, job.output()[-3000:]
    for rank in (0, 1):
        log = job.rank_log(rank)
        assert f"rank {rank}: dflash exit 143" in log and "Traceback" not in log, log[-3000:]
        assert "SIGTERM received: finishing the current step" in log
        assert f"stopped by SIGTERM at step {HELD_STEP}; continue with --resume" in log
    _say_stopped(out, HELD_STEP)
    assert RunDir(out).log.read_text().count(f"checkpoint {RunDir(out).checkpoints / 'step-00000004'}") == 1
    _resume_and_compare(tmp_path, argv, reference, ckpt.step_dir_name(HELD_STEP))


@pytest.mark.slow  # 2 torchrun launches of 2 gloo processes (about 2 min)
def test_sigkill_of_every_rank_mid_write_keeps_the_previous_checkpoint_and_resumes_into_the_same_run(
        uninterrupted, tmp_path):
    """The half-written step-4 checkpoint stays a hidden temp dir that nothing takes for a checkpoint:
    `latest` still names step 2, --resume continues from it, and its next checkpoint removes the temp dir."""
    reference, target, data = uninterrupted
    out = tmp_path / "run"
    argv = train_args(target, data, out, layout="shard", **OPTS)
    job, _held = _held_job(tmp_path, argv)
    try:
        for pid in job.ranks().values():
            os.kill(pid, signal.SIGKILL)
        assert job.wait() != 0
    finally:
        job.kill()
    assert set(job.exits().values()) == {-9}, job.output()[-3000:]
    checkpoints = RunDir(out).checkpoints
    assert ckpt.read_latest(checkpoints) == ckpt.step_dir_name(2)
    assert ckpt.latest_checkpoint(checkpoints) == checkpoints / ckpt.step_dir_name(2)
    assert sorted(p.name for p in checkpoints.iterdir()) == [".tmp-step-00000004-dcp", "latest", "step-00000002"]
    _resume_and_compare(tmp_path, argv, reference, ckpt.step_dir_name(2))


@pytest.mark.slow  # 2 launches of 2 gloo processes (about 2 min)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_the_launchers_process_group_signalled_mid_write_stops_every_rank_on_that_checkpoint(uninterrupted,
                                                                                            tmp_path, sig):
    """SIGKILL or SIGTERM to torchrun's process group (a scheduler's kill; dflash-train --nproc-per-node runs
    the same agent): torchrun starts the ranks in sessions of their own, so a SIGKILL reached only the
    launcher and left them training with nobody to report to. Each rank now gets SIGTERM when the launcher
    dies: it finishes the write, stops on it and exits 143; a SIGTERM the launcher forwards ends the same way."""
    reference, target, data = uninterrupted
    out = tmp_path / "run"
    argv = train_args(target, data, out, layout="shard", **OPTS)
    job, held = _held_job(tmp_path, argv)
    ranks = job.ranks()
    try:
        os.killpg(job.process.pid, sig)
        (held / "release").write_text("")
        code = job.wait()
        wait_for(lambda: not any(alive(pid) for pid in ranks.values()), "every rank exiting", seconds=120)
    finally:
        job.kill()
    assert code == -9 if sig == signal.SIGKILL else code != 0
    for rank in (0, 1):
        log = job.rank_log(rank)
        assert f"rank {rank}: dflash exit 143" in log and "Traceback" not in log, log[-3000:]
        went = "the launcher (pid" if sig == signal.SIGKILL else "SIGTERM received: finishing the current step"
        assert went in log and f"stopped by SIGTERM at step {HELD_STEP}; continue with --resume" in log
    _say_stopped(out, HELD_STEP)
    _resume_and_compare(tmp_path, argv, reference, ckpt.step_dir_name(HELD_STEP))
