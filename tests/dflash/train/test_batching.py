"""The run's batching (dflash.batching): chosen once from --packing, and a third one is one class and one
registry line: a toy batching registered here trains, evaluates, checkpoints, resumes and is planned for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash import batching
from dflash.batching.anchors import EVAL_ANCHOR_SEED, anchor_seed, sample_anchors
from dflash.batching.base import Batching, RankBatch, on_device
from dflash.batching.shares import padded_share
from dflash.cli import train_config, train_main
from dflash.data.batches import DataOrder, collate
from dflash.errors import CheckpointError, ConfigError
from dflash.io.drafter_dir import load_drafter
from dflash.train.records.checkpoint import load_state
from dflash.train.records.rundir import RunDir
from dflash.train.trainer import train
from tests.support.dflash_train_fixtures import drop_run_log_handlers, read_metrics, train_args


class Singles(Batching):
    """A toy third batching: each rank trains one whole sequence per micro-batch, unpadded (B = 1, T = its
    length), with its own --max-anchors anchors."""

    name, flag, unit, title = "singles", "singles", "sequences", "one unpadded sequence per rank"

    def order(self, lengths, world, epoch=0, index=0):
        return DataOrder(lengths, None, world, self.config.optim.seed, epoch=epoch, index=index)

    def take(self, epoch, indices, items, d, pad_id):
        share = padded_share(indices, items, d)
        return RankBatch(share, on_device(collate(share.items, pad_id), d.device))

    def anchors(self, rank_batch, config, epoch):
        share = rank_batch.share
        anchors = [sample_anchors(item["loss_mask"], config.model.max_anchors,
                                  torch.Generator().manual_seed(anchor_seed(config.optim.seed, epoch, i)))
                   for i, item in zip(share.indices, share.items)]
        return anchors, anchors

    def context(self, target, batch):
        return target.context(batch["input_ids"], batch["attention_mask"])

    def eval_rounds(self, config, items, d, pad_id):
        for start in range(0, len(items), d.world_size):
            share = padded_share(list(range(start, min(len(items), start + d.world_size))), items, d)
            anchors = [sample_anchors(item["loss_mask"], config.model.max_anchors,
                                      torch.Generator().manual_seed(EVAL_ANCHOR_SEED + i))
                       for i, item in zip(share.indices, share.items)]
            yield RankBatch(share, on_device(collate(share.items, pad_id), d.device), anchors, anchors)

    def worst_shapes(self, world):
        return [(1, self.config.model.max_length, self.config.model.max_anchors)]

    def smaller(self, batch, anchors, world):
        return f"{anchors} anchors per sequence fits (--max-anchors {anchors})"

    def shrink_options(self):
        return f"--max-anchors (now {self.config.model.max_anchors}) or --max-length (now {self.config.model.max_length})"


@pytest.fixture
def singles(monkeypatch):
    monkeypatch.setitem(batching.BATCHINGS, Singles.flag, Singles)  # the one registry line
    return Singles


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_drafter(RunDir(out).drafter, dtype=torch.float32).state_dict()


def test_a_third_batching_trains_evaluates_and_resumes_to_the_same_drafter(singles, tiny_chat, tmp_path):
    target, data = tiny_chat
    opts = dict(packing="singles", max_steps=4, eval_fraction=0.2, eval_every=2)
    whole = tmp_path / "whole"
    assert train_main(train_args(target, data, whole, **opts)) == 0
    records = read_metrics(whole)
    train_records = [m for m in records if m.get("split") == "train"]
    assert len(train_records) == 4 and {m.get("split") for m in records} == {"train", "eval"}
    # one sequence a step (one rank): at most --max-length tokens and one sequence's --max-anchors anchors
    assert all(m["tokens"] <= 96 and m["anchors"] <= 8 for m in train_records)
    assert "one unpadded sequence per rank" in RunDir(whole).log.read_text()

    parts = tmp_path / "parts"
    stopped = train(train_config(train_args(target, data, parts, **opts)), handle_signals=False,
                    on_step=lambda step, m: step == 2)
    assert stopped.step == 2
    assert load_state(stopped.checkpoint)["batching"] == "singles"  # what the checkpoint says made its order
    drop_run_log_handlers()
    assert train_main(train_args(target, data, parts, **opts) + ["--resume"]) == 0
    for name, w in _weights(whole).items():
        assert torch.equal(w, _weights(parts)[name]), name


def test_a_checkpoint_of_the_third_batching_resumes_only_with_it(singles, tiny_chat, tmp_path):
    target, data = tiny_chat
    out = tmp_path / "run"
    train(train_config(train_args(target, data, out, packing="singles")), handle_signals=False,
          on_step=lambda step, m: step == 1)
    drop_run_log_handlers()
    again = train_config(train_args(target, data, out, packing="off") + ["--resume"])
    with pytest.raises(CheckpointError, match="written by a run with --packing singles; its position in the data "
                                              "counts sequences"):
        train(again, handle_signals=False)


def test_the_planner_checks_the_shapes_the_third_batching_forms(singles, tiny_chat, tmp_path):
    from dflash.errors import TrainError
    from dflash.plan.memory import MicroBatch
    from dflash.plan.planner import check_training_fits, worst_micro_batches

    target, data = tiny_chat
    config = train_config(train_args(target, data, tmp_path / "run", packing="singles"))
    assert worst_micro_batches(Singles(config), 2) == [MicroBatch(1, 96, 8)]
    with pytest.raises(TrainError, match=r"a micro-batch of 1 x 96"):
        check_training_fits(config, 1, card_gb=0.1, batching=Singles(config))


def test_packing_resolves_once_per_device_and_names_what_it_takes():
    from dflash.batching.packed import Packed
    from dflash.batching.padded import Padded
    from dflash.config import TrainConfig

    config = TrainConfig.from_flat(out="x")
    assert type(batching.batching_for(config, torch.device("cpu"))) is Padded
    assert type(batching.batching_for(config, torch.device("cuda"))) is Packed
    assert type(batching.batching_for(TrainConfig.from_flat(out="x", packing="on"), torch.device("cpu"))) is Packed
    with pytest.raises(ConfigError, match="--packing is 'rows'; choose one of auto, off, on"):
        TrainConfig.from_flat(out="x", packing="rows")
    with pytest.raises(ConfigError, match="--pack-tokens 64 is below --max-length 96"):
        TrainConfig.from_flat(out="x", packing="on", pack_tokens=64, max_length=96)
    short = TrainConfig.from_flat(out="x", pack_tokens=64, max_length=96)  # auto: refused where it packs only
    assert type(batching.batching_for(short, torch.device("cpu"))) is Padded
    with pytest.raises(ConfigError, match="--pack-tokens 64"):
        batching.batching_for(short, torch.device("cuda"))
