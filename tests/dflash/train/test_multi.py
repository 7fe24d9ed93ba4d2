"""Several drafters on one target pass: each ends bit-identical to a run of it alone (same seed, same data
order), --resume continues them all, and a run whose drafters would not fit on the GPU is refused."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from dflash.cli import train_main
from dflash.config.drafters import drafter_out
from dflash.errors import ConfigError
from dflash.train.multi import check_drafters_fit, drafter_param_count, drafter_state_bytes
from dflash.train.rundir import RunDir
from tests.support.dflash_train_fixtures import read_metrics, save_chat_target, train_args, write_chat_jsonl

# Two drafters that differ in block size, depth, anchors, loss decay and learning rate.
SWEEP = """
[[drafters]]
name = "b4"

[[drafters]]
name = "b6-deep"
block-size = 6
drafter-layers = 2
max-anchors = 5
[drafters.model]
gamma = 3.0
[drafters.optim]
lr = 1e-3
warmup-ratio = 0.2
"""
ALONE = {"b4": {}, "b6-deep": dict(block_size=6, drafter_layers=2, max_anchors=5, gamma=3.0, lr=1e-3, warmup_ratio=0.2)}
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
    assert not RunDir(out).drafter.exists() and (out / "train.log").is_file()


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


def test_drafter_param_count_is_the_modules():
    from dflash.model.drafter import Drafter, DrafterConfig

    c = DrafterConfig(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=80,
                      num_hidden_layers=3, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=512,
                      vocab_size=100, block_size=4, num_target_layers=8, target_layer_ids=[1, 3, 5], mask_token_id=2)
    n = sum(p.numel() for p in Drafter(c).parameters())
    assert drafter_param_count(48, 4, 2, 16, 80, 3, 3) == n
    assert drafter_state_bytes(n) == 16 * n


def test_drafters_that_do_not_fit_are_refused_with_the_numbers():
    one = drafter_param_count(5120, 24, 4, 256, 17408, 5, 5)  # a 5-layer drafter at the 27B shape: 1.8B
    check_drafters_fit({"a": one, "b": one}, 54_000_000_000, 150_000_000_000)
    with pytest.raises(ConfigError, match=r"3 drafters do not fit.*a 29\.\d, b 29\.\d, c 29\.\d GB.*54\.0 GB"):
        check_drafters_fit({"a": one, "b": one, "c": one}, 54_000_000_000, 140_000_000_000)
