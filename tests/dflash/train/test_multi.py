"""Several drafters on one target pass: each ends bit-identical to a run of it alone (same seed, same data
order), --resume continues them all, and a run whose drafters would not fit on the GPU is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash.cli import train_main
from dflash.config.drafters import drafter_out
from dflash.train.records.rundir import RunDir
from tests.support.dflash_train_fixtures import read_metrics, save_chat_target, train_args, write_chat_jsonl

# Two drafters that differ in block size, depth, tapped target layers (the tiny target's default is [2]: the
# target pass taps [0, 1, 2]), anchors, loss decay and learning rate.
SWEEP = """
[[drafters]]
name = "b4"

[[drafters]]
name = "b6-deep"
block-size = 6
drafter-layers = 2
target-layer-ids = [0, 1]
max-anchors = 5
[drafters.model]
gamma = 3.0
[drafters.optim]
lr = 1e-3
warmup-ratio = 0.2
"""
ALONE = {"b4": {}, "b6-deep": dict(block_size=6, drafter_layers=2, target_layer_ids="0,1", max_anchors=5, gamma=3.0,
                                   lr=1e-3, warmup_ratio=0.2)}
TIMING = ("tokens_per_s", "mfu", "gpu_mem_gib")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return save_chat_target(root / "target"), write_chat_jsonl(root / "chat.jsonl", n=16)


def _weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(str(RunDir(run_dir).drafter / "model.safetensors"))


def _numbers(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k not in TIMING} for m in records]


def test_two_drafters_on_one_target_pass_equal_two_runs_alone(tiny, tmp_path):
    target, data = tiny
    common = dict(max_steps=3, grad_accum=2, save_every=2)
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(SWEEP)
    out = tmp_path / "both"
    assert train_main(train_args(target, data, out, **common) + ["--config", str(sweep)]) == 0
    for name, options in ALONE.items():
        alone = tmp_path / f"alone-{name}"
        assert train_main(train_args(target, data, alone, **common, **options)) == 0
        together = drafter_out(out, name)
        mine, theirs = _weights(together), _weights(alone)
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), (name, key)
        assert _numbers(read_metrics(together)) == _numbers(read_metrics(alone))
        assert (RunDir(together).report / "report.md").is_file()
        assert (RunDir(together).drafter / "config.json").read_text() == (RunDir(alone).drafter / "config.json").read_text()
    assert not RunDir(out).drafter.exists() and (out / "train.log").is_file()
    compare = (RunDir(out).report / "compare.md").read_text()
    rows = [line for line in compare.splitlines() if line.startswith("| b")]
    assert [r.split("|")[1].strip() for r in rows] == ["b4", "b6-deep"]
    assert len(rows[1].split("|")[-2].split()) == 5  # a_1..a_5 of the block-6 drafter
    assert (RunDir(out).report / "compare.png").stat().st_size > 0


def test_report_of_a_run_of_several_drafters(tiny, tmp_path, capsys):
    from dflash.cli import main

    target, data = tiny
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(SWEEP)
    out = tmp_path / "run"
    assert train_main(train_args(target, data, out, max_steps=1) + ["--config", str(sweep)]) == 0
    (RunDir(out).report / "compare.md").unlink()
    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "drafters/b4/report/report.md" in printed and "report/compare.md" in printed
    assert "| b6-deep | 6 | 2 |" in (RunDir(out).report / "compare.md").read_text()


def test_resume_continues_every_drafter(tiny, tmp_path):
    """4 steps in one go, versus a stop after 2 and `dflash-train --out DIR --resume` (which reads the
    drafters back from the run directory)."""
    from dflash.cli import train_config
    from dflash.config.drafters import read_drafters
    from dflash.train.multi import train_multi

    target, data = tiny
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(SWEEP)
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train_main(train_args(target, data, straight, max_steps=4) + ["--config", str(sweep)]) == 0
    config = train_config(train_args(target, data, split, max_steps=4) + ["--config", str(sweep)])
    first = train_multi(config, read_drafters(sweep), handle_signals=False, on_step=lambda step, _m: step == 2)
    assert first.stopped_by == "request" and first.step == 2
    assert not RunDir(drafter_out(split, "b4")).drafter.exists()
    assert train_main(["--out", str(split), "--resume", "--no-progress"]) == 0
    for name in ALONE:
        a, b = _weights(drafter_out(straight, name)), _weights(drafter_out(split, name))
        assert all(torch.equal(a[k], b[k]) for k in a), name
        assert [m["loss"] for m in read_metrics(drafter_out(split, name))] == \
               [m["loss"] for m in read_metrics(drafter_out(straight, name))]


@pytest.fixture(scope="module")
def target_27b(tmp_path_factory):
    """A model directory holding only the config.json of Qwen3.5-27B's text model (the planner reads no weight)."""
    from dflash.model.shapes import QWEN35_27B, qwen35_config

    path = tmp_path_factory.mktemp("27b")
    qwen35_config(QWEN35_27B).save_pretrained(path)
    return path


def _sweep_fits(target, tmp_path, layers: list[int]) -> None:
    """check_memory of drafters with these layer counts beside the 27B target on one H200 (150.1 GB usable), at
    the micro-batch the run was measured at (2 x 4096 tokens, 512 anchors per sequence, padded)."""
    from dflash.config import TrainConfig
    from dflash.config.drafters import DrafterSpec, drafter_configs
    from dflash.train.precheck import check_memory

    config = TrainConfig.from_flat(target=str(target), data=str(tmp_path / "d.jsonl"), out=str(tmp_path / "o"),
                                   packing="off", batch_size=2, max_length=4096, max_tokens=8192, max_anchors=512)
    specs = [DrafterSpec(f"d{i}", {"drafter_layers": n}) for i, n in enumerate(layers)]
    configs = drafter_configs(config, specs)
    ids = [1, 16, 31, 46, 61]
    check_memory(config, configs, {name: ids for name in configs}, 1, torch.device("cpu"), card_gb_for_tests=150.1)


def test_the_drafters_memory_check_is_the_planners_and_agrees_with_what_ran(target_27b, tmp_path):
    """On one H200 beside the 27B target two 5-layer drafters and three 3-layer ones ran, three 5-layer ones ran
    out of memory (bench/results/h200/multi-drafters-27b.json): the planner, the drafters' states added up and one
    drafter's activations at a time, says the same, and names the way out."""
    from dflash.errors import TrainError

    _sweep_fits(target_27b, tmp_path, [5, 5])
    _sweep_fits(target_27b, tmp_path, [3, 3, 3])
    with pytest.raises(TrainError, match=r"3 drafters on one target pass with a micro-batch of .*"
                                         r"train fewer drafters per run, or smaller ones"):
        _sweep_fits(target_27b, tmp_path, [5, 5, 5])


@pytest.mark.slow  # three interpreter starts with torch + transformers: 30-90 s on a 2-core machine
def test_two_drafters_under_two_gloo_processes_match_one_process(tmp_path):
    """The same two-drafter command under `torchrun --nproc-per-node 2` (each drafter in its own DDP wrapper,
    the batch of 5 split 3 + 2) and in one process: per-step losses and final weights agree to rounding."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    target = save_chat_target(tmp_path / "target")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=20)
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(SWEEP)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_HEARTBEAT": str(tmp_path / "heartbeat")}
    outs = {}
    for procs in (1, 2):
        out = tmp_path / f"procs{procs}"
        argv = train_args(target, data, out, max_steps=3, batch_size=5, grad_accum=2) + ["--config", str(sweep)]
        launcher = [sys.executable, "-m", "dflash.cli", "train"] if procs == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}",
             "-m", "dflash.cli", "train"]
        run = subprocess.run(launcher + argv, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
        outs[procs] = out
    for name in ALONE:
        one, two = read_metrics(drafter_out(outs[1], name)), read_metrics(drafter_out(outs[2], name))
        assert [m["step"] for m in two] == [1, 2, 3]
        for a, b in zip(one, two):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
            assert b["tokens"] == a["tokens"] and b["anchors"] == a["anchors"]
        w1, w2 = _weights(drafter_out(outs[1], name)), _weights(drafter_out(outs[2], name))
        for key in w1:
            torch.testing.assert_close(w2[key], w1[key], rtol=1e-4, atol=1e-6)


def test_a_run_of_several_drafters_is_kept_unless_overwritten(tiny, tmp_path, capsys):
    target, data = tiny
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(SWEEP)
    out = tmp_path / "run"
    argv = train_args(target, data, out, max_steps=1) + ["--config", str(sweep)]
    assert train_main(argv) == 0
    assert train_main(argv) == 2
    assert "already holds a run" in capsys.readouterr().err
    (out / "keep.txt").write_text("not the run's")
    assert train_main(argv + ["--overwrite"]) == 0
    assert (out / "keep.txt").is_file() and [m["step"] for m in read_metrics(drafter_out(out, "b4"))] == [1]


def test_a_drafter_tapping_a_layer_the_engines_cannot_tap_is_refused(tiny, tmp_path, capsys):
    target, data = tiny
    sweep = tmp_path / "sweep.toml"
    sweep.write_text('[[drafters]]\nname = "a"\n[[drafters]]\nname = "last"\ntarget-layer-ids = [1, 3]\n')
    out = tmp_path / "run"
    assert train_main(train_args(target, data, out) + ["--config", str(sweep)]) != 0
    assert "drafter 'last': the drafter could not be served: target layer id 3 is the target's last layer" \
        in capsys.readouterr().err
    assert not (out / "drafters").exists()  # refused before the target loaded and the drafters were written


def test_each_drafter_evaluates_as_it_would_alone(tiny, tmp_path):
    """With an evaluation split and tau measured by speculative decoding, each drafter's evaluation records
    (its own target view: the drafter tapping layers 0 and 1 gets only those) equal a run of it alone."""
    target, data = tiny
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(SWEEP)
    common = dict(max_steps=2, eval_fraction=0.25, eval_tau_prompts=2, eval_new_tokens=8)
    out = tmp_path / "both"
    assert train_main(train_args(target, data, out, **common) + ["--config", str(sweep)]) == 0
    alone = tmp_path / "alone"
    assert train_main(train_args(target, data, alone, **common, **ALONE["b6-deep"])) == 0

    def evals(run):
        return [{k: v for k, v in m.items() if k not in TIMING + ("eval_s",)}
                for m in read_metrics(run) if m.get("split") == "eval"]

    mine = evals(drafter_out(out, "b6-deep"))
    assert mine and "tau" in mine[-1] and mine == evals(alone)


def test_resume_refuses_drafters_checkpointed_at_different_steps(tiny, tmp_path, capsys):
    target, data = tiny
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(SWEEP)
    out = tmp_path / "run"
    assert train_main(train_args(target, data, out, max_steps=2, save_every=1) + ["--config", str(sweep)]) == 0
    # as if the run had stopped after writing b4's step-2 checkpoint and before b6-deep's
    (RunDir(drafter_out(out, "b6-deep")).checkpoints / "latest").write_text("step-00000001\n")
    assert train_main(["--out", str(out), "--resume", "--max-steps", "3", "--no-progress"]) == 3
    assert "not at the same step (b4 at step 2, b6-deep at step 1)" in capsys.readouterr().err


def test_several_drafters_under_pipeline_on_one_process_are_refused_before_loading(tiny, tmp_path, capsys):
    target, data = tiny
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(SWEEP)
    out = tmp_path / "run"
    assert train_main(train_args(target, data, out) + ["--config", str(sweep), "--layout", "pipeline"]) == 2
    err = capsys.readouterr().err
    assert "--nproc-per-node 2" in err and "Traceback" not in err
    assert not (out / "drafters").exists()


@pytest.mark.slow  # one torchrun launch of 2 gloo processes: a drafter rank and a target stage (about 60 s)
def test_a_dflash_and_a_dflash2_drafter_train_on_one_pipelined_target(tiny, tmp_path):
    """The rig of a target on some GPUs and several drafters on the others: the stage taps the union of the
    drafters' layers and serves it once per micro-batch; the drafter rank trains both, each exporting its kind."""
    import os
    import subprocess
    import sys

    from dflash.io.drafter_dir import load_drafter
    from dflash.kinds.dflash2.dflash2_drafter import DFlash2Drafter

    target, data = tiny
    sweep = tmp_path / "sweep.toml"
    sweep.write_text('[[drafters]]\nname = "one"\ntarget-layer-ids = "1"\n\n'
                     '[[drafters]]\nname = "two"\ndrafter-kind = "dflash2"\ntarget-layer-ids = "1,2"\n')
    out = tmp_path / "rig"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_HEARTBEAT": str(tmp_path / "heartbeat")}
    argv = ["--nproc-per-node", "2", *train_args(target, data, out, layout="pipeline", target_stages=1, max_steps=2,
                                                  save_every=1), "--config", str(sweep)]
    done = subprocess.run([sys.executable, "-m", "dflash.cli", "train", *argv], env=env, capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr[-3000:]
    for name, second in (("one", False), ("two", True)):
        drafter = load_drafter(RunDir(drafter_out(out, name)).drafter)
        assert isinstance(drafter, DFlash2Drafter) == second
        assert drafter.config.target_layer_ids == ([1, 2] if second else [1])
