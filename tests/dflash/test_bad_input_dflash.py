"""Bad input and faults for `dflash-train`, `dflash-eval`, `dflash report` and `dflash regenerate` on the tiny
chat target: each case runs the real command line on real files and asserts the exit code
(dflash/errors.py: options 2, checkpoint 3, training 4, target 5, data 6, drafter 7, server 8, run
directory in use 10), the key words of the message, no traceback, that the cheap checks fail before the
target's weights load, that --out holds nothing new but what the case allows (train.log, which then says
why the run stopped, and the run's lock file), and that the token cache holds no partial build; a refused
run into a directory that holds another run leaves every file there as it was.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

import pytest

from common.fsutil import exclusive
from dflash.cli import eval_main, main, train_main
from dflash.train.records.rundir import RunDir
from tests.support.bad_input import assert_clear_failure, snapshot
from tests.support.dflash_train_fixtures import drop_run_log_handlers, save_chat_target, train_args, write_chat_jsonl

LOADED = "Loading weights"  # transformers' progress line when the target's weights load


@pytest.fixture(autouse=True)
def no_handlers_left_by_a_run():
    """Each run of dflash-train gives the "dflash" logger handlers bound to that test's stderr and train.log;
    a later command in this process (report, regenerate) must not log into them (one process, one command
    outside tests)."""
    yield
    drop_run_log_handlers()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target, its data, and a finished run with a checkpoint to damage."""
    root = tmp_path_factory.mktemp("world")
    target = save_chat_target(root / "target")
    data = write_chat_jsonl(root / "chat.jsonl")
    assert train_main(train_args(target, data, root / "run", max_steps=4, save_every=2)) == 0  # step 2 and 4
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


def flip_state_bytes(out: Path) -> None:
    """Overwrite bytes inside the pickle of trainer_state.pt: the zip index still reads, the contents do not."""
    path = ckpt_dir(out) / "trainer_state.pt"
    data = bytearray(path.read_bytes())
    data[200:260] = b"x" * 60
    path.write_bytes(bytes(data))


def edit_manifest(change: Callable[[dict], object]):
    """Damage the latest checkpoint's manifest.json: `change` edits its parsed JSON in place."""
    def damage(out: Path) -> None:
        path = ckpt_dir(out) / "manifest.json"
        doc = json.loads(path.read_text())
        change(doc)
        path.write_text(json.dumps(doc))
    return damage


def cut_manifest(out: Path) -> None:
    path = ckpt_dir(out) / "manifest.json"
    path.write_bytes(path.read_bytes()[:100])


def change_train_config_in_place(out: Path) -> None:
    """A hand edit of the checkpoint's train_config.json that keeps its size: only the sha256 tells."""
    path = ckpt_dir(out) / "train_config.json"
    text = path.read_text()
    assert '"seed": 0' in text
    path.write_text(text.replace('"seed": 0', '"seed": 7'))


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


def edit_metrics(**fields_by_line):
    """Damage metrics.jsonl of a copy of the finished run: line{N}={field: value} replaces those fields."""
    def damage(out: Path) -> None:
        path = RunDir(out).metrics
        lines = path.read_text().splitlines()
        for name, fields in fields_by_line.items():
            n = int(name.removeprefix("line")) - 1
            lines[n] = json.dumps({**json.loads(lines[n]), **fields})
        path.write_text("\n".join(lines) + "\n")
    return damage


def damage_run_config(out: Path) -> None:
    RunDir(out).config.write_text('{"target": "x", ')


# --- bad inputs made in the test's own tmp dir --------------------------------------------------------
def target_copy(world, tmp: Path, edit: Callable[[Path], None]) -> None:
    shutil.copytree(world["target"], tmp / "target")
    edit(tmp / "target")


def edit_json(name: str, change: Callable[[dict], None]):
    def edit(directory: Path) -> None:
        data = json.loads((directory / name).read_text())
        change(data)
        (directory / name).write_text(json.dumps(data))
    return edit


def chat_lines(world) -> list[str]:
    return world["data"].read_text().splitlines()


def write_data(name: str, make: Callable[[list[str]], bytes]):
    """tmp/<name>, its bytes made from the world's chat lines."""
    return lambda w, t: (t / name).write_bytes(make(chat_lines(w)))


def long_record(lines: list[str]) -> bytes:
    record = json.loads(lines[0])
    record["messages"][1]["content"] = "x" * 50_000  # > --max-length 96 x 128 bytes per token
    return ("\n".join(lines[:2] + [json.dumps(record)] + lines[2:]) + "\n").encode()


def out_of_order(lines: list[str]) -> bytes:
    first = json.loads(lines[0])
    first["messages"] = first["messages"][1:]  # starts with the assistant
    second = json.loads(lines[1])
    second["messages"] = second["messages"][:1] + second["messages"]  # two users in a row
    return ("\n".join(lines[:3] + [json.dumps(first), json.dumps(second)] + lines[3:]) + "\n").encode()


KILLED_MID_BUILD = """
import os, signal, sys, tempfile
from pathlib import Path
from dflash.data.token_cache import _build_prefix
final = Path(sys.argv[1]) / ("0" * 20)
final.parent.mkdir(parents=True, exist_ok=True)
tmp = Path(tempfile.mkdtemp(prefix=_build_prefix(final), dir=final.parent))  # as build() makes it
(tmp / "work-train").mkdir()
(tmp / "work-train" / "read.arrow").write_bytes(bytes(4096))
os.kill(os.getpid(), signal.SIGKILL)
"""


def plant_stale_builds(w, t: Path) -> None:
    """A partial token-cache build left by a process killed outright (SIGKILL: no clean-up ran), and one of
    another host (alive, as far as this host can tell)."""
    cache = t / "tokenized-cache"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_BUILD, str(cache)], env=env)
    assert killed.returncode == -9 and len(list(cache.glob(".*.tmp-*"))) == 1
    (cache / f".{'1' * 20}.tmp-otherhost-{os.getpid()}-running").mkdir()


def metrics_on_a_full_disk(out: Path) -> None:
    """The finished run, continued: its metrics.jsonl is on a disk that is full (every write: ENOSPC)."""
    RunDir(out).metrics.unlink()
    RunDir(out).metrics.symlink_to("/dev/full")


def log_on_a_full_disk(out: Path) -> None:
    """The finished run, continued: its train.log is on a disk that is full (every write: ENOSPC)."""
    RunDir(out).log.unlink()
    RunDir(out).log.symlink_to("/dev/full")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


ANY = None  # Case.leaves: a run that trains may write everything a run writes


@dataclass
class Case:
    id: str
    prog: Callable[[list[str]], int]
    argv: Callable[[dict, Path], list[str]]  # (world, tmp) -> arguments
    code: int
    words: tuple[str, ...]
    cheap: bool = False  # must fail before the target's weights load
    resume_from: Callable[[Path], None] | None = None  # damage a copy of the finished run in tmp/out
    prepare: Callable[[dict, Path], None] | None = None  # make the bad input in tmp
    absent: tuple[str, ...] = ()  # must not be in the output (torch's advice, the API's spelling of an option)
    leaves: tuple[str, ...] | None = ("train.log",)  # what tmp/out may hold new afterwards (ANY: not checked)
    log_words: tuple[str, ...] = ()  # tmp/out/train.log must say these
    seconds: float | None = None  # must be done within this
    check: Callable[[Path], None] | None = None  # more to assert of tmp afterwards
    held: Callable[[Path], object] | None = None  # a context (e.g. another run's lock) around the command
    untouched: bool = False  # every file already in tmp/out keeps its content (train.log too)
    kept: bool = False  # every file already in tmp/out keeps its content, but train.log only grows (the refusal)
    xfail: str | None = None  # a fix that lives in a file this suite's changes could not touch
    before_load: bool = False  # every one of `words` is printed before the target's weights load
    slow: bool = False  # runs in make test's slow tier only (the built-in demo)


def train(**extra):
    return lambda w, t: train_args(w["target"], extra.pop("data", None) or w["data"], t / "out",
                                   **{k: v for k, v in extra.items()})


def train_flags(*flags: str, data: str | None = None, target: str | None = None):
    return lambda w, t: train_args(Path(target.format(t=t)) if target else w["target"],
                                   Path(data.format(t=t)) if data else w["data"], t / "out") + list(flags)


def report(w, t: Path) -> list[str]:
    return ["report", str(t / "out")]


def regenerate_refused(w, t: Path) -> list[str]:
    return ["regenerate", "--endpoint", f"http://127.0.0.1:{free_port()}", "--model", "m", "--data", str(w["data"]),
            "--out", str(t / "out" / "regen.jsonl"), "--no-progress"]


def evaluate(*flags: str):
    return lambda w, t: ["--target", str(w["target"]), "--data", str(w["data"]), "--limit", "2",
                         "--max-new-tokens", "4", "--device", "cpu", *flags]


def evaluate_run(*flags: str, data: str | None = None, prompts: str | None = None, drafter: str | None = None):
    """dflash-eval of the finished run's drafter (or `drafter`, made in tmp) on the world's data (or the
    `data` / `prompts` path, "{t}" standing for tmp)."""
    def argv(w, t: Path) -> list[str]:
        source = (["--prompts", prompts.format(t=t)] if prompts else
                  ["--data", data.format(t=t) if data else str(w["data"])])
        return ["--target", str(w["target"]), "--drafter", drafter.format(t=t) if drafter else str(w["run"] / "drafter"),
                *source, "--limit", "2", "--max-new-tokens", "4", "--device", "cpu", *flags]
    return argv


def drafters_of_kinds(*expected: tuple[str | None, str]):
    """A check that tmp/out holds, for each (drafter name or None for the run's own, kind), a checkpoint with its
    DCP shards and an exported drafter of that kind."""
    def check(t: Path) -> None:
        from dflash.config.drafters import drafter_out
        from dflash.io.drafter_dir import load_drafter
        from dflash.kinds import kind_of
        from dflash.train.records import checkpoint as ckpt

        for name, kind in expected:
            run = RunDir(drafter_out(t / "out", name) if name else t / "out")
            assert any((ckpt.latest_checkpoint(run.checkpoints) / "dcp").glob("*.distcp")), run.root
            assert kind_of(load_drafter(run.drafter)).name == kind, run.root
    return check


def two_kinds_in_one_file(w, t: Path) -> None:
    (t / "sweep.toml").write_text('[[drafters]]\nname = "one"\n\n[[drafters]]\nname = "two"\ndrafter-kind = "dflash2"\n')


def two_runs_of_one_kind(w, t: Path) -> None:
    shutil.copytree(w["run"] / "drafter", t / "a" / "drafter")
    shutil.copytree(w["run"] / "drafter", t / "b" / "drafter")


def data_dir(w, t: Path) -> None:
    (t / "prompts").mkdir()
    shutil.copy(w["data"], t / "prompts" / "chat.jsonl")


def drafter_tapping_the_last_layer(w, t: Path) -> None:
    """The finished run's drafter with its last tapped id moved to the target's last layer (4 layers: id 3),
    as a third party's drafter for vLLM could have it: the same tensor shapes, a valid config."""
    shutil.copytree(w["run"] / "drafter", t / "drafter")
    edit_json("config.json", lambda d: d["dflash_config"]["target_layer_ids"].__setitem__(
        -1, d["num_target_layers"] - 1))(t / "drafter")


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
         ("model.safetensors", "damaged", "without --resume"), True, resume_from=damage_weights),
    Case("resume-damaged-state", train_main, train_flags("--resume"), 3,
         ("trainer_state.pt is damaged", "echo step-00000002 >", "start over without --resume"), True,
         resume_from=damage_state, absent=("weights_only",)),
    Case("resume-state-contents-damaged", train_main, train_flags("--resume"), 3,
         ("trainer_state.pt is damaged", "UnpicklingError", "echo step-00000002 >", "start over without --resume"),
         True, resume_from=flip_state_bytes, absent=("weights_only", "add_safe_globals")),
    # the checkpoint's manifest.json (the size and sha256 of each file): damaged itself, or naming a damaged file
    Case("resume-manifest-cut-short", train_main, train_flags("--resume"), 3,
         ("manifest.json is damaged (it is not valid JSON", "cut short", "echo step-00000002 >"), True,
         resume_from=cut_manifest, kept=True),
    Case("resume-manifest-files-a-list", train_main, train_flags("--resume"), 3,
         ('manifest.json is damaged (it holds {"files": ["drafter/config.json"', 'not {"files": {path:'), True,
         resume_from=edit_manifest(lambda d: d.update(files=sorted(d["files"]))), kept=True),
    Case("resume-manifest-entry-a-string", train_main, train_flags("--resume"), 3,
         ('manifest.json is damaged (its entry for trainer_state.pt is "abc", not {"size"', "echo step-00000002 >"),
         True, resume_from=edit_manifest(lambda d: d["files"].update({"trainer_state.pt": "abc"})), kept=True),
    Case("resume-manifest-size-a-string", train_main, train_flags("--resume"), 3,
         ('its entry for trainer_state.pt has size "', 'not a whole number of bytes'), True, absent=("were written",),
         resume_from=edit_manifest(lambda d: d["files"]["trainer_state.pt"].update(
             size=str(d["files"]["trainer_state.pt"]["size"]))), kept=True),
    Case("resume-manifest-size-left-out", train_main, train_flags("--resume"), 3,
         ("its entry for drafter/model.safetensors has size null, not a whole number of bytes",), True,
         resume_from=edit_manifest(lambda d: d["files"]["drafter/model.safetensors"].pop("size")), kept=True),
    Case("resume-manifest-sha-a-number", train_main, train_flags("--resume"), 3,
         ("its entry for train_config.json has sha256 12, not 64 hexadecimal digits",), True,
         resume_from=edit_manifest(lambda d: d["files"]["train_config.json"].update(sha256=12)), kept=True),
    Case("resume-manifest-path-outside", train_main, train_flags("--resume"), 3,
         ('manifest.json is damaged (it lists "/etc/hostname", which is not a path inside the checkpoint',), True,
         resume_from=edit_manifest(lambda d: d["files"].update({"/etc/hostname": {"size": 1, "sha256": "0" * 64}})),
         kept=True),
    Case("resume-manifest-lists-nothing", train_main, train_flags("--resume"), 3,
         ("drafter/config.json is damaged (the manifest does not list it", "move it out", "echo step-00000002 >"), True,
         resume_from=edit_manifest(lambda d: d["files"].clear()), kept=True),
    Case("resume-manifest-deleted", train_main, train_flags("--resume"), 3,
         ("manifest.json is damaged (it is missing, though the checkpoint's trainer state says it was written with one",
          "echo step-00000002 >"), True, resume_from=lambda out: (ckpt_dir(out) / "manifest.json").unlink(), kept=True),
    Case("resume-file-the-manifest-lists-missing", train_main, train_flags("--resume"), 3,
         ("drafter/modeling_dflash.py is damaged (it is missing; the manifest lists it", "echo step-00000002 >"), True,
         resume_from=lambda out: (ckpt_dir(out) / "drafter" / "modeling_dflash.py").unlink(), kept=True),
    Case("resume-file-changed-same-size", train_main, train_flags("--resume"), 3,
         ("train_config.json is damaged (it changed since it was written (sha256", "echo step-00000002 >"), True,
         resume_from=change_train_config_in_place, kept=True),
    Case("resume-file-put-there-afterwards", train_main, train_flags("--resume"), 3,
         ("notes.txt is damaged (the manifest does not list it", "move it out"), True,
         resume_from=lambda out: (ckpt_dir(out) / "notes.txt").write_text("mine\n"), kept=True),
    # options that change the drafter's shape: refused by flag before the target loads, --out as it was
    Case("resume-another-drafter-kind", train_main, train_flags("--resume", "--drafter-kind", "dflash2"), 3,
         ("holds a drafter trained with --drafter-kind dflash;", "asks for --drafter-kind dflash2",
          "resume with --drafter-kind dflash (the options the run started with are in"), True,
         resume_from=as_it_was, kept=True),
    Case("resume-another-block-size", train_main, train_flags("--resume", "--block-size", "8"), 3,
         ("trained with --block-size 4;", "asks for --block-size 8", "resume with --block-size 4"), True,
         resume_from=as_it_was, kept=True),
    Case("resume-more-drafter-layers-and-a-window", train_main,
         train_flags("--resume", "--drafter-layers", "2", "--sliding-window", "8"), 3,
         ("trained with --drafter-layers 1 --sliding-window 0;", "asks for --drafter-layers 2 --sliding-window 8"),
         True, resume_from=as_it_was, kept=True),
    Case("resume-other-target-layers", train_main, train_flags("--resume", "--target-layer-ids", "1"), 3,
         ("trained with --target-layer-ids 2;", "asks for --target-layer-ids 1"), True, resume_from=as_it_was,
         kept=True),
    Case("bad-block-size", train_main, train_flags("--block-size", "0"), 2, ("block",), True),
    Case("pack-shorter-than-max-length", train_main, train_flags("--packing", "on", "--pack-tokens", "64"), 2,
         ("--pack-tokens 64 is below --max-length 96", "Raise --pack-tokens"), True),
    Case("resume-padded-run-packed", train_main, train_flags("--resume", "--packing", "on", "--pack-tokens", "256"), 3,
         ("written by a run with --packing off", "counts padded batches", "Resume with --packing off"),
         resume_from=as_it_was, kept=True),
    Case("out-holds-a-run", train_main, train_flags(), 2, ("already holds a run", "latest checkpoint step-00000004",
         "--resume", "--overwrite", "another --out"), True, resume_from=as_it_was, untouched=True, leaves=()),
    Case("out-used-by-another-run", train_main, train_flags(), 10,
         ("another dflash-train run is using", "is held by pid", "another directory"), True,
         held=lock_held_by_another_run, untouched=True, leaves=()),
    Case("resume-and-overwrite", train_main, train_flags("--resume", "--overwrite"), 2,
         ("--resume continues", "--overwrite deletes it", "give one of them"), True, resume_from=as_it_was,
         untouched=True, leaves=()),
    Case("overwrite-a-model-dir", train_main, train_flags("--overwrite"), 2,
         ("config.json that dflash-train did not write", "a directory of its own"), True,
         resume_from=foreign_config, untouched=True, leaves=()),
    Case("block-size-0-one-message", train_main, train_flags("--block-size", "0"), 2,
         ("--block-size is 0", "2 or more"), True, absent=("at least 1",)),
    Case("resume-run-config-wrong-type", train_main, train_flags("--resume"), 2, ("config.json", "block_size"), True,
         resume_from=lambda out: edit_json(RunDir(out).config.name,
                                           lambda d: d["model"].update(block_size="four"))(out)),
    # the target's files, checked before its weights load
    Case("target-config-without-model-type", train_main, train_flags(target="{t}/target"), 5,
         ("config.json", 'no "model_type"', "restore the config.json"), True,
         prepare=lambda w, t: target_copy(w, t, edit_json("config.json", lambda d: d.pop("model_type")))),
    Case("target-config-not-json", train_main, train_flags(target="{t}/target"), 5,
         ("config.json is not valid JSON", "download the model again"), True,
         prepare=lambda w, t: target_copy(w, t, lambda d: (d / "config.json").write_text('{"model_type": "qwen3",'))),
    Case("target-without-mask-token", train_main, train_flags(target="{t}/target"), 5,
         ("has no mask token", "--mask-token '<|MASK|>'"), True,
         prepare=lambda w, t: target_copy(w, t, edit_json("tokenizer_config.json", lambda d: d.pop("mask_token")))),
    # the data, checked before the target's weights load where a glance at the files tells
    Case("data-empty-file", train_main, train_flags(data="{t}/empty.jsonl"), 6, ("empty.jsonl is empty",), True,
         prepare=write_data("empty.jsonl", lambda lines: b"\n  \n")),
    Case("data-dir-without-shards", train_main, train_flags(data="{t}/data"), 6,
         ("no .jsonl, .json or .parquet shard", "point --data at the data files"), True,
         prepare=lambda w, t: (t / "data").mkdir() or (t / "data" / "notes.txt").write_text("x")),
    Case("data-bom-before-the-first-record", train_main, train_flags("--on-bad-line", "stop", data="{t}/bom.jsonl"),
         0, ("read 24, kept 24, skipped 0",), leaves=ANY,
         prepare=write_data("bom.jsonl", lambda lines: b"\xef\xbb\xbf" + ("\n".join(lines) + "\n").encode())),
    Case("data-record-too-long-skipped", train_main, train_flags(data="{t}/long.jsonl"), 0,
         ("read 25, kept 24, skipped 1 (1 too_long)", "long.jsonl:3: too_long", "--max-length"), leaves=ANY,
         prepare=write_data("long.jsonl", long_record)),
    Case("data-record-too-long-stop", train_main, train_flags("--on-bad-line", "stop", data="{t}/long.jsonl"), 6,
         ("long.jsonl:3: too_long", "50,496 bytes", "--max-length", "--on-bad-line skip"),
         prepare=write_data("long.jsonl", long_record), leaves=("train.log", "config.json")),
    Case("data-roles-out-of-order-counted", train_main, train_flags(data="{t}/order.jsonl"), 0,
         ("skipped 2 (2 roles_out_of_order)", "order.jsonl:4: roles out of order: message 1 is 'assistant'",
          "order.jsonl:5: roles out of order: messages 1 and 2 are both 'user'"), leaves=ANY,
         prepare=write_data("order.jsonl", out_of_order)),
    Case("data-roles-out-of-order-stop", train_main, train_flags("--on-bad-line", "stop", data="{t}/order.jsonl"), 6,
         ("order.jsonl:4: roles out of order", "--on-bad-line skip"), prepare=write_data("order.jsonl", out_of_order),
         leaves=("train.log", "config.json")),
    Case("token-cache-partial-build-of-a-killed-run", train_main, train_flags(), 0,
         ("a partial tokenised cache left by a run that was killed",), leaves=ANY, prepare=plant_stale_builds,
         check=lambda t: [*(t / "tokenized-cache").glob(".*otherhost*")] or pytest.fail("another host's build went")),
    # the run's own files
    Case("metrics-on-a-full-disk", train_main, train_flags("--resume", "--max-steps", "6"), 4,
         ("metrics.jsonl", "No space left on device", "Free space on that disk",
         "continue from its last checkpoint (step-00000004)"),
         resume_from=metrics_on_a_full_disk, log_words=("stopped: writing the run's files", "No space left")),
    Case("train-log-on-a-full-disk", train_main, train_flags("--resume", "--max-steps", "6"), 0,
         ("cannot write", "train.log (No space left on device)", "on stderr only"), absent=("Logging error",),
         resume_from=log_on_a_full_disk, leaves=ANY),
    Case("report-metrics-wrong-types", main, report, 0,
         ('metrics.jsonl line 1: loss is "abc", not a number', "line 2: tokens_per_s is [1, 2], not a number",
          "line 3: step is \"three\""),
         resume_from=edit_metrics(line1={"loss": "abc"}, line2={"tokens_per_s": [1, 2]}, line3={"step": "three"})),
    Case("report-run-config-not-json", main, report, 0, ("config.json: cannot be read",),
         resume_from=damage_run_config),
    # an inference server
    Case("regenerate-nothing-listens", main, regenerate_refused, 8,
         ("nothing listens at http://127.0.0.1:", "--endpoint", "no output was written"), leaves=(), seconds=10),
    Case("eval-drafter-missing", eval_main, evaluate("--drafter", "runs/nope"), 7, ("runs/nope", "does not exist")),
    Case("eval-drafter-damaged", eval_main, lambda w, t: evaluate("--drafter", str(ckpt_dir(t / "out") / "drafter"))(w, t),
         7, ("model.safetensors is damaged",), resume_from=damage_weights),
    Case("eval-limit-zero", eval_main, evaluate("--drafter", "runs/nope", "--limit", "0"), 2, ("--limit",)),
    # dflash-eval's prompts, read before any model loads
    Case("eval-data-a-directory", eval_main, evaluate_run(data="{t}/prompts"), 6,
         ("--data", "prompts is a directory (it holds chat.jsonl)", "pass one file"), True, prepare=data_dir),
    Case("eval-data-file-missing", eval_main, evaluate_run(data="{t}/missing.jsonl"), 6,
         ("--data", "missing.jsonl: no such file", "chat JSONL file"), True),
    Case("eval-prompts-file-missing", eval_main, evaluate_run(prompts="{t}/prompts.txt"), 6,
         ("--prompts", "prompts.txt: no such file", "one user prompt per line"), True),
    Case("eval-prompts-empty", eval_main, evaluate_run(prompts="{t}/prompts.txt"), 6,
         ("no prompt found in --prompts", "prompts.txt"), True,
         prepare=lambda w, t: (t / "prompts.txt").write_text("\n  \n")),
    # a drafter SGLang cannot serve: evaluated (vLLM serves it), with a warning before anything loads
    Case("eval-drafter-taps-the-last-layer", eval_main, evaluate_run("--no-baselines", drafter="{t}/drafter"), 0,
         ("dflash-eval: warning:", "target layer id 3 is the target's last layer", "SGLang cannot serve",
          "vLLM serves it", "for vLLM only"), prepare=drafter_tapping_the_last_layer, before_load=True),
    Case("eval-compare-drafter-missing", eval_main, evaluate_run("--compare", "runs/nope", "--no-baselines"), 7,
         ("runs/nope", "does not exist"), True),
    # what crashed once: each now a run that ends well
    Case("eval-compare-drafter-damaged-refused-before-evaluating", eval_main,
         lambda w, t: evaluate_run("--compare", str(ckpt_dir(t / "out") / "drafter"), "--no-baselines")(w, t), 7,
         ("model.safetensors is damaged",), True, resume_from=damage_weights),
    Case("eval-compare-two-drafters-of-one-kind-two-rows", eval_main,
         lambda w, t: evaluate_run("--compare", str(t / "a" / "drafter"), "--compare", str(t / "b" / "drafter"),
                                   "--no-baselines")(w, t), 0,
         ("dflash drafter ", "/b/drafter "), prepare=two_runs_of_one_kind),
    Case("dflash2-under-shard-checkpoints", train_main,
         train(drafter_kind="dflash2", layout="shard", max_steps=2, save_every=1, drafter_layers=2), 0,
         ("drafter written to",), leaves=ANY, check=drafters_of_kinds((None, "dflash2"))),
    Case("dflash2-under-offload-checkpoints", train_main,
         train(drafter_kind="dflash2", layout="offload", max_steps=2, save_every=1, drafter_layers=2), 0,
         ("drafter written to",), leaves=ANY, check=drafters_of_kinds((None, "dflash2"))),
    Case("dflash-and-dflash2-under-shard-checkpoint", train_main,
         lambda w, t: train(layout="shard", max_steps=2, save_every=1)(w, t) + ["--config", str(t / "sweep.toml")],
         0, ("training 2 drafters",), leaves=ANY, prepare=two_kinds_in_one_file,
         check=drafters_of_kinds(("one", "dflash"), ("two", "dflash2"))),
    Case("demo-under-shard-evaluates", train_main,
         lambda w, t: ["--layout", "shard", "--max-steps", "5", "--out", str(t / "out"), "--no-progress"], 0,
         ("trained drafter", "repeat last token"), leaves=ANY, slow=True,
         check=lambda t: RunDir(t / "out").eval_results.is_file() or pytest.fail("no eval_results.json")),
]


def _param(case: Case):
    marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
    marks += [pytest.mark.slow] if case.slow else []
    return pytest.param(case, id=case.id, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input(case: Case, world, tmp_path, capsys):
    if case.resume_from:
        case.resume_from(copy_run(world, tmp_path))
    if case.prepare:
        case.prepare(world, tmp_path)
    out = tmp_path / "out"
    before = snapshot(out)
    contents = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} if out.exists() else {}
    argv = case.argv(world, tmp_path)
    start = time.monotonic()
    with case.held(out) if case.held else nullcontext():
        try:
            code = case.prog(argv)
        except SystemExit as e:  # argparse's own errors
            code = e.code
    elapsed = time.monotonic() - start
    captured = capsys.readouterr()
    text = captured.err + captured.out
    assert_clear_failure(code, case.code, text, case.words)
    for word in case.absent:
        assert word not in text, f"{word!r} in: {text}"
    if case.cheap:
        assert LOADED not in text, "the check ran only after the target's weights were loaded"
    if case.before_load:
        assert LOADED in text, text
        assert all(text.index(word) < text.index(LOADED) for word in case.words), text
    if case.seconds is not None:
        assert elapsed < case.seconds, f"took {elapsed:.1f} s"
    if case.leaves is not ANY:
        new = snapshot(out) - before - {str(out / name) for name in case.leaves} - {str(RunDir(out).lock)}
        assert not new, f"--out holds new files: {sorted(new)}"
    if case.untouched:
        assert {p: p.read_bytes() for p in contents} == contents, "a file in --out changed"
    if case.kept:
        log, lock = RunDir(out).log, RunDir(out).lock
        changed = [str(p) for p, data in contents.items()
                   if p not in (log, lock) and (not p.is_file() or p.read_bytes() != data)]
        assert not changed, f"files in --out changed or went: {changed}"
        assert log.read_bytes().startswith(contents.get(log, b"")), "train.log lost lines"
    if case.log_words:
        log = RunDir(out).log.read_text()
        for word in case.log_words:
            assert word in log, f"{word!r} not in train.log: {log}"
    partial = [p.name for p in (tmp_path / "tokenized-cache").glob(".*") if "otherhost" not in p.name]
    assert not partial, f"the token cache holds partial builds: {partial}"
    if case.check:
        case.check(tmp_path)


def test_a_full_disk_while_checkpointing_is_a_checkpoint_error_in_train_log(world, tmp_path, monkeypatch, capsys):
    import dflash.train.records.checkpoint as ckpt

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
