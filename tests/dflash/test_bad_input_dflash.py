"""Bad input and faults for `dflash-train` / `dflash-eval` on the tiny chat target: each case runs the real
command line and asserts the exit code (dflash/errors.py: options 2, checkpoint 3, target 5, data 6,
drafter 7, run directory in use 10), the key words of the message, no traceback, that the cheap checks
fail before the target's weights load, and that --out holds nothing new but train.log (which then says
why the run stopped) and the run's lock file; a refused run into a directory that holds another run
leaves every file there as it was.
"""

from __future__ import annotations

import errno
import json
import shutil
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

import pytest

from common.fsutil import exclusive
from dflash.cli import eval_main, train_main
from dflash.train.rundir import RunDir
from tests.support.bad_input import assert_clear_failure, snapshot
from tests.support.dflash_train_fixtures import save_chat_target, train_args, write_chat_jsonl

LOADED = "Loading weights"  # transformers' progress line when the target's weights load


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target, its data, and a finished run with a checkpoint to damage."""
    root = tmp_path_factory.mktemp("world")
    target = save_chat_target(root / "target")
    data = write_chat_jsonl(root / "chat.jsonl")
    assert train_main(train_args(target, data, root / "run", max_steps=2, save_every=2)) == 0
    return {"target": target, "data": data, "run": root / "run"}


def copy_run(world, tmp: Path) -> Path:
    out = tmp / "out"
    shutil.copytree(world["run"], out)
    return out


def ckpt_dir(out: Path) -> Path:
    return RunDir(out).checkpoints / (RunDir(out).checkpoints / "latest").read_text().strip()


def damage_weights(out: Path) -> None:
    path = ckpt_dir(out) / "drafter" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])


def damage_state(out: Path) -> None:
    (ckpt_dir(out) / "trainer_state.pt").write_bytes(b"not a torch file")


def point_latest_nowhere(out: Path) -> None:
    (RunDir(out).checkpoints / "latest").write_text("step-00009999\n")


def as_it_was(out: Path) -> None:
    """The finished run, untouched."""


def foreign_config(out: Path) -> None:
    """A config.json that dflash-train did not write: --out points at a model directory."""
    RunDir(out).config.write_text(json.dumps({"model_type": "qwen3", "hidden_size": 32}))


def lock_held_by_another_run(out: Path):
    out.mkdir(parents=True, exist_ok=True)
    return exclusive(out, "dflash-train run", lock_name=RunDir(out).lock.name)


@dataclass
class Case:
    id: str
    prog: Callable[[list[str]], int]
    argv: Callable[[dict, Path], list[str]]  # (world, tmp) -> arguments
    code: int
    words: tuple[str, ...]
    cheap: bool = False  # must fail before the target's weights load
    resume_from: Callable[[Path], None] | None = None  # damage a copy of the finished run in tmp/out
    held: Callable[[Path], object] | None = None  # a context (e.g. another run's lock) around the command
    untouched: bool = False  # every file already in tmp/out keeps its content (train.log too)


def train(**extra):
    return lambda w, t: train_args(w["target"], extra.pop("data", None) or w["data"], t / "out",
                                   **{k: v for k, v in extra.items()})


def train_flags(*flags: str, data: str | None = None):
    return lambda w, t: train_args(w["target"], Path(data.format(t=t)) if data else w["data"], t / "out") + list(flags)


def evaluate(*flags: str):
    return lambda w, t: ["--target", str(w["target"]), "--data", str(w["data"]), "--limit", "2",
                         "--max-new-tokens", "4", "--device", "cpu", *flags]


CASES = [
    Case("data-missing", train_main, train_flags(data="{t}/missing.jsonl"), 6, ("missing.jsonl", "no such file"), True),
    Case("eval-data-missing", train_main, train_flags("--eval-data", "/nonexistent/held_out.jsonl"), 6,
         ("--eval-data", "no such file"), True),
    Case("layer-ids-out-of-range", train_main, train_flags("--target-layer-ids", "0,99"), 5,
         ("[99] do not exist", "4 layers"), True),
    Case("layer-ids-repeat", train_main, train_flags("--target-layer-ids", "1,1"), 5, ("repeat a layer",), True),
    Case("mask-token-unknown", train_main, train_flags("--mask-token", "<nope>"), 5,
         ("'<nope>' is not in the target's vocabulary", "add_special_tokens"), True),
    Case("target-not-a-model", train_main, lambda w, t: train_args(w["data"].parent, w["data"], t / "out"), 5,
         ("no config.json",), True),
    Case("resume-nothing", train_main, train_flags("--resume"), 2, ("no run to continue", "drop --resume"), True),
    Case("resume-latest-points-nowhere", train_main, train_flags("--resume"), 3,
         ("step-00009999", "not a complete checkpoint", "step-00000002"), resume_from=point_latest_nowhere),
    Case("resume-damaged-weights", train_main, train_flags("--resume"), 3,
         ("model.safetensors", "damaged", "without --resume"), resume_from=damage_weights),
    Case("resume-damaged-state", train_main, train_flags("--resume"), 3, ("trainer_state.pt", "without --resume"),
         resume_from=damage_state),
    Case("bad-block-size", train_main, train_flags("--block-size", "0"), 2, ("block",), True),
    Case("out-holds-a-run", train_main, train_flags(), 2, ("already holds a run", "latest checkpoint step-00000002",
         "--resume", "--overwrite", "another --out"), True, resume_from=as_it_was, untouched=True),
    Case("out-used-by-another-run", train_main, train_flags(), 10,
         ("another dflash-train run is using", "is held by pid", "another directory"), True,
         held=lock_held_by_another_run, untouched=True),
    Case("resume-and-overwrite", train_main, train_flags("--resume", "--overwrite"), 2,
         ("--resume continues", "--overwrite deletes it", "give one of them"), True, resume_from=as_it_was,
         untouched=True),
    Case("overwrite-a-model-dir", train_main, train_flags("--overwrite"), 2,
         ("config.json that dflash-train did not write", "a directory of its own"), True,
         resume_from=foreign_config, untouched=True),
    Case("eval-drafter-missing", eval_main, evaluate("--drafter", "runs/nope"), 7, ("runs/nope", "does not exist")),
    Case("eval-drafter-damaged", eval_main, lambda w, t: evaluate("--drafter", str(ckpt_dir(t / "out") / "drafter"))(w, t),
         7, ("model.safetensors is damaged",), resume_from=damage_weights),
    Case("eval-limit-zero", eval_main, evaluate("--drafter", "runs/nope", "--limit", "0"), 2, ("--limit",)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, world, tmp_path, capsys):
    out = tmp_path / "out"
    if case.resume_from:
        case.resume_from(copy_run(world, tmp_path))
    before = snapshot(out)
    contents = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} if out.exists() else {}
    argv = case.argv(world, tmp_path)
    with case.held(out) if case.held else nullcontext():
        try:
            code = case.prog(argv)
        except SystemExit as e:  # argparse's own errors
            code = e.code
    err = capsys.readouterr().err
    assert_clear_failure(code, case.code, err, case.words)
    if case.cheap:
        assert LOADED not in err, "the check ran only after the target's weights were loaded"
    allowed = {str(RunDir(out).lock)} | (set() if case.untouched else {str(RunDir(out).log)})
    new = snapshot(out) - before - allowed
    assert not new, f"--out holds new files: {sorted(new)}"
    if case.untouched:
        assert {p: p.read_bytes() for p in contents} == contents, "a file in --out changed"


def test_a_full_disk_while_checkpointing_is_a_checkpoint_error_in_train_log(world, tmp_path, monkeypatch, capsys):
    import dflash.train.checkpoint as ckpt

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "atomic_write", full)
    out = tmp_path / "out"
    code = train_main(train_args(world["target"], world["data"], out, max_steps=2, save_every=2))
    err = capsys.readouterr().err
    assert code == 3 and "No space left on device" in err and "Traceback" not in err
    log = RunDir(out).log.read_text()
    assert "stopped: writing checkpoint" in log and "No space left" in log
    assert not [p for p in RunDir(out).checkpoints.iterdir() if p.name.startswith(".tmp-")]
