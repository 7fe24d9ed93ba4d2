"""A DFlash and a DFlash2 drafter trained on one target pass (the same data, the same micro-batches) each
end bit-identical to a run of it alone; the memory check counts DFlash2's extra parameters."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from dflash.cli import train_main
from dflash.config.drafters import drafter_out
from dflash.train.records.rundir import RunDir
from tests.support.dflash_train_fixtures import read_metrics, save_chat_target, train_args, write_chat_jsonl

SWEEP = """
[[drafters]]
name = "dflash"

[[drafters]]
name = "dflash2"
drafter-kind = "dflash2"
selector-missing = "inject"
"""
TIMING = ("tokens_per_s", "mfu", "gpu_mem_gib")


def test_dflash_and_dflash2_on_one_target_pass_equal_their_runs_alone(tmp_path):
    target, data = save_chat_target(tmp_path / "target"), write_chat_jsonl(tmp_path / "chat.jsonl", n=12)
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(SWEEP)
    out = tmp_path / "both"
    assert train_main(train_args(target, data, out, max_steps=2) + ["--config", str(sweep)]) == 0
    alone_options = {"dflash": {}, "dflash2": dict(drafter_kind="dflash2", selector_missing="inject")}
    for name, options in alone_options.items():
        alone = tmp_path / f"alone-{name}"
        assert train_main(train_args(target, data, alone, max_steps=2, **options)) == 0
        mine = load_file(str(RunDir(drafter_out(out, name)).drafter / "model.safetensors"))
        theirs = load_file(str(RunDir(alone).drafter / "model.safetensors"))
        assert mine.keys() == theirs.keys()
        assert any(k.startswith("candidate_selector.") for k in mine) == (name == "dflash2")
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), (name, key)
        strip = [{k: v for k, v in m.items() if k not in TIMING} for m in read_metrics(drafter_out(out, name))]
        assert strip == [{k: v for k, v in m.items() if k not in TIMING} for m in read_metrics(alone)]
