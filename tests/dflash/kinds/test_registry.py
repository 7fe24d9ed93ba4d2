"""The drafter-kind registry (dflash.kinds): the rest of the code asks a kind, so a third kind is one module
and one registry line. The kind below (its output scaled by a config key) is registered for these tests only;
it goes through the real writer and reader, training step, decoding proposer and planner, none of which names
it."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from dflash.data.batches import collate
from dflash.decode.proposers import Sampler, as_proposer
from dflash.errors import ConfigError
from dflash.io.drafter_dir import load_drafter, save_drafter
from dflash.kinds import DFLASH, DFLASH2, KINDS, build_drafter, by_architecture, check_kind, kind_of, named
from dflash.kinds.kind import DrafterKind
from dflash.model.drafter import Drafter, DrafterConfig
from dflash.model.target import Target
from dflash.plan.sizes import drafter_shape, target_shape_from_dir
from dflash.train.step import micro_batch_sums
from tests.support.dflash_tiny import save_tiny_target

BS = 4


@dataclass(kw_only=True)
class ScaledConfig(DrafterConfig):
    output_scale: float = 0.5


class ScaledDrafter(Drafter):
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs) * self.config.output_scale


SCALED = DrafterKind(
    name="scaled", title="Scaled", summary="DFlash with its output scaled (a test kind)",
    config_class=ScaledConfig, model_class=ScaledDrafter,
    architecture="ScaledDFlashDraftModel", model_file="modeling_scaled.py", remote_code=DFLASH.remote_code,
    own_keys=("output_scale",), read_keys=lambda dflash_config, where: {"output_scale": dflash_config["output_scale"]},
    objective=DFLASH.objective, options=(), propose=DFLASH.propose,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_target(tmp_path_factory.mktemp("target"), "qwen3_5")
    return path, Target.load(path, layer_ids=[1, 3, 5])


@pytest.fixture
def scaled(monkeypatch):
    monkeypatch.setitem(KINDS, SCALED.name, SCALED)
    return SCALED


def _batch():
    g = torch.Generator().manual_seed(0)
    items = [{"input_ids": torch.randint(4, 90, (n,), generator=g), "loss_mask": torch.ones(n, dtype=torch.long)}
             for n in (24, 17)]
    return collate(items, pad_id=0), [torch.tensor([2, 9]), torch.tensor([3, 8])]


def test_a_third_kind_is_written_read_trained_decoded_and_planned(scaled, tiny, tmp_path):
    path, target = tiny
    torch.manual_seed(0)
    drafter = build_drafter(named("scaled").new_config(target, 2, BS))
    assert type(drafter) is ScaledDrafter and kind_of(drafter) is scaled

    directory = save_drafter(drafter, tmp_path / "d", dtype=torch.float32)
    data = json.loads((directory / "config.json").read_text())
    assert data["architectures"] == ["ScaledDFlashDraftModel"]
    assert data["auto_map"] == {"AutoModel": "modeling_scaled.ScaledDFlashDraftModel"}
    assert data["dflash_config"]["output_scale"] == 0.5 and (directory / "modeling_scaled.py").is_file()
    loaded = load_drafter(directory)
    assert type(loaded) is ScaledDrafter and loaded.config == drafter.config
    assert all(torch.equal(v, drafter.state_dict()[k]) for k, v in loaded.state_dict().items())

    batch, anchors = _batch()
    sums = micro_batch_sums(loaded, target, batch, anchors, block_size=BS, gamma=None, autocast_dtype=torch.float32)
    sums.loss_sum.backward()
    assert torch.isfinite(sums.loss_sum) and loaded.fc.weight.grad.abs().sum() > 0

    ids = batch["input_ids"][0, :10].tolist()
    draft = as_proposer(loaded).propose(target, ids, target.context(torch.tensor([ids[:-1]])), Sampler())
    assert len(draft.tokens) == BS - 1

    shape = drafter_shape(target_shape_from_dir(path), layers=2, block_size=BS, tapped=3, kind="scaled")
    assert shape.params == sum(p.numel() for p in drafter.parameters())


def test_each_kind_is_found_by_its_config_its_model_and_its_architecture():
    for kind in (DFLASH, DFLASH2):
        config = kind.config_class(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                   head_dim=16, intermediate_size=64, vocab_size=96, block_size=BS,
                                   num_target_layers=4, target_layer_ids=[1], mask_token_id=95)
        assert kind_of(config) is kind and kind_of(kind.build(config)) is kind and kind_of(kind.config_class) is kind
        assert by_architecture(["Other", kind.architecture]) is kind
    assert by_architecture(["LlamaForCausalLM"]) is None


def test_an_unknown_kind_is_refused_by_name_and_a_mismatch_names_the_fix():
    with pytest.raises(ConfigError, match="--drafter-kind is 'dflash3'; choose one of dflash, dflash2"):
        named("dflash3")
    with pytest.raises(TypeError, match="no drafter config or drafter of a known kind"):
        kind_of(object())
    config = DFLASH2.config_class(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                  head_dim=16, intermediate_size=64, vocab_size=96, block_size=BS,
                                  num_target_layers=4, target_layer_ids=[1], mask_token_id=95)
    with pytest.raises(ConfigError, match="DIR is a dflash2 drafter and --drafter-kind is dflash; pass --drafter-kind dflash2"):
        check_kind(config, "dflash", "DIR")
