"""The serving rules checked when training starts (dflash/io/engines.py): no tapped layer at the target's
last layer, and a mask token id SGLang resolves to the same id."""

from __future__ import annotations

import pytest
import torch

from dflash.errors import DrafterError, TargetError
from dflash.io.fit import check_fits_target
from dflash.io.engines import check_servable, last_layer_problem, mask_token_problem
from dflash.model.drafter import DrafterConfig
from dflash.model.target import Target
from tests.support.dflash_tiny import build_tokenizer, save_tiny_target


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    from tests.support.dflash_train_fixtures import save_chat_target, write_chat_jsonl

    root = tmp_path_factory.mktemp("chat")
    return save_chat_target(root / "target"), write_chat_jsonl(root / "chat.jsonl", n=8)


def test_the_last_layer_is_not_the_hf_hidden_state_the_docs_name(tmp_path):
    """Why L-1 is refused: for id l < L-1 the tapped state is HF hidden_states[l + 1], for l = L-1 it is
    not (hidden_states[L] is after the final norm), and SGLang does not capture it at all."""
    target = Target.load(save_tiny_target(tmp_path / "t", "qwen3", num_layers=6), layer_ids=[4, 5])
    tokens = torch.randint(4, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    context = target.context(tokens)
    hidden = target.model(tokens, output_hidden_states=True).hidden_states
    assert torch.allclose(context[..., :32], hidden[5], atol=1e-6)       # id 4 -> hidden_states[5]
    assert not torch.allclose(context[..., 32:], hidden[6], atol=1e-3)   # id 5 -> not hidden_states[6]
    assert "last layer" in last_layer_problem([4, 5], 6) and last_layer_problem([1, 4], 6) is None


def test_dflash_train_refuses_the_last_layer_before_loading_the_target(chat, tmp_path, capsys):
    from dflash.cli import train_main
    from tests.support.dflash_train_fixtures import train_args

    target, data = chat  # 4 layers
    assert train_main(train_args(target, data, tmp_path / "run", max_steps=1, target_layer_ids="1,3")) == 5
    err = capsys.readouterr().err
    assert "target layer id 3 is the target's last layer" in err and "SGLang refuses it" in err
    assert train_main(train_args(target, data, tmp_path / "ok", max_steps=1, target_layer_ids="1,2")) == 0


def test_training_with_a_loaded_target_refuses_the_last_layer_too(chat, tmp_path):
    """The same rule where the precheck does not run: a Target handed to train()."""
    from dflash.config import TrainConfig
    from dflash.train.setup import drafter_config

    target = Target.load(chat[0], layer_ids=[0, 3])
    with pytest.raises(TargetError, match="target layer id 3 is the target's last layer"):
        drafter_config(TrainConfig.from_flat(out=str(tmp_path), block_size=4), target)


def test_sglang_mask_rule(chat):
    from transformers import AutoTokenizer

    tokenizer = build_tokenizer()  # <|MASK|> is id 3
    assert mask_token_problem(tokenizer, 3) is None
    assert "is not the id of the target tokenizer's <|MASK|> (3)" in mask_token_problem(tokenizer, 5)
    # SGLang looks the token up in the vocabulary: declared as the mask token or not, it counts.
    assert mask_token_problem(build_tokenizer(with_mask=False), 5) is not None
    # No <|MASK|> in the vocabulary (the demo tokenizer's is <|mask|>): SGLang takes the configured id.
    assert mask_token_problem(AutoTokenizer.from_pretrained(chat[0]), 3) is None


def test_dflash_train_refuses_a_mask_token_sglang_would_refuse(tmp_path, capsys):
    from dflash.cli import train_main
    from tests.support.dflash_train_fixtures import train_args, write_chat_jsonl

    target = save_tiny_target(tmp_path / "t", "qwen3")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=2)
    assert train_main(train_args(target, data, tmp_path / "run", max_steps=1, mask_token="w1")) == 5
    assert "SGLang resolves a drafter's mask_token_id against that token" in capsys.readouterr().err
    with pytest.raises(TargetError, match="mask token id 5"):
        check_servable([1, 2], 6, build_tokenizer(), 5)


def test_a_drafter_with_another_mask_id_than_the_tokenizers_mask_is_refused(tmp_path):
    target = Target.load(save_tiny_target(tmp_path / "t", "qwen3"))
    config = DrafterConfig.from_target(target, num_hidden_layers=1, block_size=4)
    check_fits_target(config, target)
    config.mask_token_id = 7
    with pytest.raises(DrafterError, match="mask token id 7 is not the id of the target tokenizer's <.MASK.> .3."):
        check_fits_target(config, target)


def test_the_docs_show_the_pinned_engine_versions():
    from pathlib import Path

    from tests.support.serving_wheels import pins

    docs = (Path(__file__).resolve().parents[3] / "docs" / "evaluation-and-serving.md").read_text()
    section = docs[docs.index("### Versions checked"):]
    for pin in pins().values():
        assert f"| {pin.name}" in section and f"| {pin.version} |" in section, pin
    assert "vLLM 0.34.0" in section and "SGLang 0.5.23" in section
