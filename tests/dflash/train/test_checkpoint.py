"""Checkpoints: atomic writes (a failed write leaves the previous one intact), weights_only loading,
refusal to resume against another target / drafter shape / data, pruning."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from dflash.train.records import checkpoint as ckpt
from dflash.config import TrainConfig
from dflash.io.drafter_dir import load_drafter
from dflash.errors import CheckpointError
from dflash.model.drafter import Drafter, DrafterConfig
from dflash.train.schedule import lr_lambda


def _drafter_config(**overrides) -> DrafterConfig:
    values = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                  intermediate_size=32, vocab_size=40, block_size=4, num_target_layers=4, target_layer_ids=[0, 1],
                  mask_token_id=3, target_fingerprint="f00d")
    values.update(overrides)
    return DrafterConfig(**values)


def _parts(seed: int = 0):
    """A drafter that took one AdamW step (so the optimizer has state), with its scheduler."""
    torch.manual_seed(seed)
    drafter = Drafter(_drafter_config())
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(10, 0.1))
    sum(p.square().sum() for p in drafter.parameters()).backward()
    opt.step()
    sched.step()
    return drafter, opt, sched


def _save(root, step, parts, keep=2, fingerprint="data0"):
    drafter, opt, sched = parts
    return ckpt.save_checkpoint(root, step=step, drafter=drafter, optimizer=opt, scheduler=sched,
                                train_state={"epoch": 0, "batch_index": step, "data_fingerprint": fingerprint},
                                config=TrainConfig(), keep=keep)


def test_checkpoint_round_trip_loads_with_weights_only(tmp_path):
    parts = _parts()
    path = _save(tmp_path, 3, parts)
    assert path.name == "step-00000003" and ckpt.latest_checkpoint(tmp_path) == path
    # plain torch.load with weights_only=True must accept the file: no pickled objects inside
    raw = torch.load(path / ckpt.STATE_FILE, weights_only=True)
    assert raw["step"] == 3 and raw["batch_index"] == 3
    state = ckpt.load_state(path)
    opt = torch.optim.AdamW(Drafter(_drafter_config()).parameters(), lr=1e-3)
    opt.load_state_dict(state["optimizer"])
    exp_avg = next(iter(opt.state.values()))["exp_avg"]
    assert torch.equal(exp_avg, next(iter(parts[1].state.values()))["exp_avg"])
    assert TrainConfig.from_json(path / "train_config.json") == TrainConfig()
    loaded = load_drafter(path / "drafter")
    for a, b in zip(loaded.state_dict().values(), parts[0].state_dict().values()):
        assert torch.equal(a, b)


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    parts = _parts()
    first = _save(tmp_path, 1, parts)
    before = (first / ckpt.STATE_FILE).read_bytes()

    def disk_full(fd):  # the bytes went out, but the disk fills before they are on it
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(CheckpointError, match="No space left.*previous checkpoint is intact"):
        _save(tmp_path, 2, parts)
    assert ckpt.read_latest(tmp_path) == "step-00000001"
    assert ckpt.latest_checkpoint(tmp_path) == first
    assert (first / ckpt.STATE_FILE).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]  # no temp dirs left
    assert ckpt.load_state(first)["step"] == 1


def test_truncated_state_file_gives_a_clear_error(tmp_path):
    path = _save(tmp_path, 1, _parts())
    (path / ckpt.STATE_FILE).write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(CheckpointError, match="cannot load .*Delete"):
        ckpt.load_state(path)


def test_old_checkpoints_are_pruned(tmp_path):
    parts = _parts()
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, parts, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000003", "step-00000004"]
    assert ckpt.read_latest(tmp_path) == "step-00000004"


def test_same_step_twice_replaces_it(tmp_path):
    parts = _parts()
    _save(tmp_path, 5, parts)
    _save(tmp_path, 5, parts)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert ckpt.load_state(tmp_path / "step-00000005")["step"] == 5


def test_resume_refuses_another_target(tmp_path):
    path = _save(tmp_path, 1, _parts())
    other = _drafter_config(target_fingerprint="beef").to_dict()
    with pytest.raises(CheckpointError, match="different target .*f00d.*beef"):
        ckpt.check_compatible(path, other, "data0")


def test_resume_refuses_another_drafter_shape(tmp_path):
    path = _save(tmp_path, 1, _parts())
    other = _drafter_config(num_hidden_layers=2, block_size=8).to_dict()
    with pytest.raises(CheckpointError, match="different shape .*block_size: checkpoint 4, now 8.*num_hidden_layers"):
        ckpt.check_compatible(path, other, "data0")


def test_resume_refuses_other_data(tmp_path):
    path = _save(tmp_path, 1, _parts(), fingerprint="data0")
    ckpt.check_compatible(path, _drafter_config().to_dict(), "data0")  # the same run fits
    with pytest.raises(CheckpointError, match="different data"):
        ckpt.check_compatible(path, _drafter_config().to_dict(), "data1")


def test_export_drafter_replaces_the_previous_copy(tmp_path):
    first = _save(tmp_path / "ck", 1, _parts(seed=0))
    dest = ckpt.export_drafter(first, tmp_path / "drafter")
    second = _save(tmp_path / "ck", 2, _parts(seed=1))
    ckpt.export_drafter(second, dest)
    exported, trained = load_drafter(dest, dtype=torch.bfloat16), load_drafter(second / "drafter")
    assert json.loads((dest / "config.json").read_text())["dtype"] == "bfloat16"  # what the engines serve
    assert json.loads((second / "drafter" / "config.json").read_text())["dtype"] == "float32"  # resume is exact
    for name, value in trained.state_dict().items():
        assert torch.equal(exported.state_dict()[name], value.to(torch.bfloat16)), name
    ckpt.export_drafter(second, dest, dtype=torch.float32)
    assert (dest / "model.safetensors").read_bytes() == (second / "drafter" / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "drafter"]
