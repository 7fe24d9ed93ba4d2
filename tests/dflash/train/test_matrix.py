"""Every drafter kind under every layout, alone and two kinds on one target pass, fresh and resumed at another
world size (gloo processes on CPU, the tiny chat target):

    {dflash2 alone, dflash and dflash2 on one target pass} x {replicate, shard, offload, pipeline}
        fresh     2 processes (pipeline: a target stage and a drafter rank), 4 steps, a checkpoint at step 2,
                  an evaluation on held-out data at steps 2 and 4 through the layout's own path (pipeline
                  refuses one: its exported drafter is what dflash-eval reads), the drafter exported in fp32
        resumed   from that step-2 checkpoint at another world size (1 process; pipeline: 3, two drafter
                  ranks), to step 4, exported again

Each exported drafter equals the one-process replicate run of the same drafters to 1e-6 (absolute, fp32
weights near 0.02): the layouts add the same float32 sums in another order (all-reduce over ranks, sharded
gradients), which parts them by a few float32 ulps after four steps, not more (docs/training.md, Layouts).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash.cli import train_main
from dflash.config.drafters import drafter_out
from dflash.io.drafter_dir import load_drafter
from dflash.kinds.dflash2.dflash2_drafter import DFlash2Drafter
from dflash.train.records.rundir import RunDir
from tests.support.dflash_train_fixtures import drop_run_log_handlers, train_args, write_chat_jsonl

REPO = Path(__file__).resolve().parents[3]
# One drafter alone (DFlash2; DFlash alone under every layout is tests/dflash/train/test_layouts.py's), and a
# DFlash beside a DFlash2 drafter on one target pass.
SETS = {"dflash2": [("dflash2", "dflash2")], "both": [("one", "dflash"), ("two", "dflash2")]}
LAYOUTS = ("replicate", "shard", "offload", "pipeline")
TOLERANCE = 1e-6


def _argv(tiny_chat, out: Path, drafters: str, layout: str, tmp: Path, *extra: str) -> list[str]:
    target, data = tiny_chat
    opts = dict(layout=layout, max_steps=4, save_every=2, keep_checkpoints=3, drafter_dtype="fp32",
                drafter_layers=1, target_layer_ids="1,2")
    if layout == "pipeline":
        opts["target_stages"] = 1
    else:  # held-out data, so the training sequences are the same as the pipeline's
        opts.update(eval_data=write_chat_jsonl(tmp / "held-out.jsonl", n=6, seed=1), eval_every=2)
    argv = train_args(target, data, out, **opts)
    if len(SETS[drafters]) > 1:
        sweep = tmp / f"{drafters}.toml"
        sweep.write_text("".join(f'[[drafters]]\nname = "{n}"\ndrafter-kind = "{k}"\n\n' for n, k in SETS[drafters]))
        argv += ["--config", str(sweep)]
    elif SETS[drafters][0][1] == "dflash2":
        argv += ["--drafter-kind", "dflash2"]
    return argv + list(extra)


def _exported(out: Path, drafters: str) -> dict[str, dict[str, torch.Tensor]]:
    found = {}
    for name, kind in SETS[drafters]:
        run = RunDir(drafter_out(out, name)) if len(SETS[drafters]) > 1 else RunDir(out)
        drafter = load_drafter(run.drafter, dtype=torch.float32)
        assert isinstance(drafter, DFlash2Drafter) == (kind == "dflash2"), (out, name)
        found[name] = drafter.state_dict()
    return found


def _launch(nproc: int, argv: list[str], tmp: Path) -> None:
    """One torchrun launch of `dflash-train argv` on `nproc` gloo processes (a process group is made once per
    process: each run gets its own launch)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_HEARTBEAT": str(tmp / "heartbeat")}
    done = subprocess.run([sys.executable, "-m", "dflash.cli", "train", "--nproc-per-node", str(nproc), *argv],
                          env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def _close(got: dict, want: dict, what: str) -> None:
    for name, weights in want.items():
        assert got[name].keys() == weights.keys(), (what, name)
        worst = max(float((got[name][k] - w).abs().max()) for k, w in weights.items())
        assert worst <= TOLERANCE, f"{what}, drafter {name}: weights differ by up to {worst:.2e} > {TOLERANCE}"


@pytest.fixture(scope="module")
def reference(tiny_chat, tmp_path_factory):
    """Each drafter set's exported drafters from one plain process (replicate, world size 1)."""
    root = tmp_path_factory.mktemp("reference")
    out = {}
    for drafters in SETS:
        assert train_main(_argv(tiny_chat, root / drafters, drafters, "replicate", root)) == 0
        drop_run_log_handlers()
        out[drafters] = _exported(root / drafters, drafters)
    return out


def _rewind(out: Path, drafters: str) -> None:
    """Point every drafter of the run at its step-2 checkpoint, as if it had stopped there."""
    names = [n for n, _k in SETS[drafters]]
    for name in names:
        run = RunDir(drafter_out(out, name)) if len(names) > 1 else RunDir(out)
        (run.checkpoints / "latest").write_text("step-00000002\n")


@pytest.mark.slow  # per layout two launches of 2 gloo processes, then the resumes (about 1 minute)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_kind_and_drafter_set_trains_and_resumes_at_another_world_size_like_one_process(
        layout, tiny_chat, reference, tmp_path):
    fresh = {drafters: tmp_path / drafters for drafters in SETS}
    for drafters, out in fresh.items():
        _launch(2, _argv(tiny_chat, out, drafters, layout, tmp_path), tmp_path)
    for drafters, out in fresh.items():
        _close(_exported(out, drafters), reference[drafters], f"{layout} on 2 processes, {drafters}")
        _rewind(out, drafters)
    resumes = [_argv(tiny_chat, out, drafters, layout, tmp_path, "--resume") for drafters, out in fresh.items()]
    for argv in resumes:
        if layout == "pipeline":  # a stage and two drafter ranks: the drafter state resharded over two
            _launch(3, argv, tmp_path)
        else:
            assert train_main(argv) == 0
            drop_run_log_handlers()
    for drafters, out in fresh.items():
        _close(_exported(out, drafters), reference[drafters], f"{layout} resumed at another world size, {drafters}")
