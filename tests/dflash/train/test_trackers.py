"""Trackers and evaluation during training: a short CPU run on the tiny target with --report-to
tensorboard and an evaluation split; its TensorBoard event files are read back with tensorboard's
EventAccumulator. Optional trackers that are not installed fail with the command that installs them."""

from __future__ import annotations

import builtins
import json

import pytest

from dflash.cli import train_main
from dflash.errors import ConfigError
from dflash.train.step import acceptance_sums, summarize
from dflash.config import check_report_to
from dflash.train.records.rundir import RunDir
from dflash.train.records.trackers import open_trackers, scalars
from dflash.train.evaluation import prompt_of, split_items
from tests.support.dflash_train_fixtures import read_metrics, save_chat_target, train_args, write_chat_jsonl

EVAL_ARGS = dict(max_steps=4, eval_every=2, eval_fraction=0.25, eval_tau_prompts=2, eval_new_tokens=6)


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """4 steps, an evaluation at steps 2 and 4 (with measured tau), TensorBoard on."""
    root = tmp_path_factory.mktemp("tracked")
    target, data = save_chat_target(root / "target"), write_chat_jsonl(root / "chat.jsonl", n=24)
    out = root / "run"
    assert train_main(train_args(target, data, out, **EVAL_ARGS) + ["--report-to", "tensorboard"]) == 0
    return out


def _event_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_holds_the_training_and_evaluation_scalars(tracked_run):
    tags = _event_scalars(RunDir(tracked_run).tensorboard)
    for name in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/acc",
                 "train/acc_per_pos/1", "train/accept_per_pos/3"):
        assert [step for step, _ in tags[name]] == [1, 2, 3, 4], name
    for name in ("eval/loss", "eval/acc", "eval/tau", "eval/tau_replay", "eval/accept_per_pos/1"):
        assert [step for step, _ in tags[name]] == [2, 4], name
    records = read_metrics(tracked_run)
    train = [r for r in records if r["split"] == "train"]
    assert [v for _, v in tags["train/loss"]] == pytest.approx([r["loss"] for r in train], rel=1e-6)
    assert "train/mfu" not in tags and "train/gpu_mem_gib" not in tags  # GPU only


def test_metrics_jsonl_has_eval_records(tracked_run):
    evals = [r for r in read_metrics(tracked_run) if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert r["sequences"] == 6 and r["tau_prompts"] == 2
        assert len(r["accept_per_pos"]) == len(r["acc_per_pos"]) == 3  # block size 4
        assert 1.0 <= r["tau"] <= 4.0 and 1.0 <= r["tau_replay"] <= 4.0 and "tau_est" not in r
    assert "tensorboard" in json.loads(RunDir(tracked_run).config.read_text())["watch"]["report_to"]


def test_only_rank_0_opens_trackers(tmp_path):
    assert open_trackers(["tensorboard"], RunDir(tmp_path), {}, is_main=False).trackers == []
    assert not RunDir(tmp_path).tensorboard.exists()


@pytest.mark.parametrize("name", ["wandb", "trackio"])
def test_missing_optional_tracker_names_the_install(tmp_path, monkeypatch, name):
    real_import = builtins.__import__

    def no_such_module(module, *args, **kwargs):
        if module == name:
            raise ImportError(f"No module named '{name}'")
        return real_import(module, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_such_module)
    with pytest.raises(ConfigError, match=f"`pip install {name}`"):
        open_trackers([name], RunDir(tmp_path), {})


def test_report_to_names_are_checked():
    assert check_report_to(["tensorboard,wandb", "tensorboard"]) == ["tensorboard", "wandb"]
    assert check_report_to(["none"]) == [] and check_report_to([]) == []
    with pytest.raises(ConfigError, match="choose from none, tensorboard, wandb, trackio"):
        check_report_to(["tensorbord"])
    with pytest.raises(ConfigError, match="none cannot go with"):
        check_report_to(["none", "wandb"])


def test_scalars_flatten_per_position_lists():
    record = {"step": 3, "split": "eval", "loss": 1.5, "acc_per_pos": [0.5, 0.25], "tau": float("nan")}
    assert scalars(record, "eval") == {"eval/loss": 1.5, "eval/acc_per_pos/1": 0.5, "eval/acc_per_pos/2": 0.25}


def test_acceptance_against_a_plain_loop():
    import torch

    g = torch.Generator().manual_seed(0)
    correct = torch.rand(3, 5, 6, generator=g) < 0.7
    valid = torch.rand(3, 5, 6, generator=g) < 0.9
    valid = valid.cumprod(-1).bool()  # labels end at the sequence's end: valid is a prefix of the block
    accepted, reached = acceptance_sums(correct, valid)
    want_acc, want_reach = torch.zeros(6), torch.zeros(6)
    for b in range(3):
        for n in range(5):
            for k in range(6):
                if valid[b, n, k] and all(correct[b, n, j] for j in range(k)):
                    want_reach[k] += 1
                    want_acc[k] += bool(correct[b, n, k])
    assert accepted.tolist() == want_acc.tolist() and reached.tolist() == want_reach.tolist()
    k = 6
    totals = torch.cat([torch.tensor([2.0, 4.0]), torch.ones(k), torch.ones(k), torch.tensor([10.0, 2.0]),
                        accepted, reached])
    m = summarize(totals, block_size=k + 1)
    a = (want_acc / want_reach.clamp(min=1)).tolist()
    assert m["accept_per_pos"] == pytest.approx(a, abs=1e-4) and m["loss"] == 0.5 and "tau_est" not in m


def test_eval_split_is_seeded_and_disjoint():
    import torch

    items = [{"input_ids": torch.arange(i, i + 8), "loss_mask": torch.tensor([0, 0, 1, 1, 1, 1, 1, 1])}
             for i in range(20)]
    train, held = split_items(items, 0.2, seed=0)
    again, held_again = split_items(items, 0.2, seed=0)
    assert len(held) == 4 and len(train) == 16
    assert [int(h["input_ids"][0]) for h in held] == [int(h["input_ids"][0]) for h in held_again]
    assert {int(t["input_ids"][0]) for t in train}.isdisjoint(int(h["input_ids"][0]) for h in held)
    assert split_items(items, 0.0, seed=0) == (items, [])
    assert prompt_of(items[3]) == [3, 4]
    with pytest.raises(ConfigError, match="leaves none to train on"):
        split_items(items[:1], 0.5, seed=0)
