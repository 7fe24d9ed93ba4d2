"""A DFlash2 drafter trained by dflash-train decodes losslessly at temperature 0, proposing the selector's
greedy walk; its cached context computes what its uncached forward computes."""

import pytest
import torch

from dflash.cli import train_main
from dflash.errors import ConfigError, DflashError
from dflash.decode.evaluate import DrafterProposer, Sampler, evaluate, load_for_eval
from dflash.model.dflash2 import DFlash2Drafter
from tests.support.dflash_train_fixtures import save_chat_target, train_args, write_chat_jsonl


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2")
    target, data = save_chat_target(root / "target"), write_chat_jsonl(root / "chat.jsonl", n=8)
    argv = train_args(target, data, root / "run", max_steps=3, target_layer_ids="0,1,2", drafter_layers=2,
                      sliding_window=3, drafter_kind="dflash2")
    assert train_main(argv) == 0
    return root


def test_a_trained_dflash2_drafter_decodes_exactly_the_greedy_output(run):
    target, drafter = load_for_eval(run / "target", run / "run" / "drafter")
    assert isinstance(drafter, DFlash2Drafter)
    prompts = [[5, 9, 12, 40, 41], [7, 7, 8, 50, 51, 52]]
    result = evaluate(target, drafter, prompts, 16)
    assert result["lossless"] is True and result["mismatched_prompts"] == []
    assert 1.0 <= result["tau"] <= drafter.config.block_size


def test_the_cached_context_equals_the_uncached_forward(run):
    target, drafter = load_for_eval(run / "target", run / "run" / "drafter")
    tokens = [5, 9, 12, 40, 41, 42, 43]
    context = target.context(torch.tensor([tokens]))
    cached, uncached = DrafterProposer(drafter, incremental=True), DrafterProposer(drafter, incremental=False)
    for cut in (4, 6):
        new = context[:, (0 if cut == 4 else 4):cut]
        a = cached.propose(target, tokens[:cut + 1], new, Sampler()).tokens
        b = uncached.propose(target, tokens[:cut + 1], new, Sampler()).tokens
        assert a == b
    with pytest.raises(DflashError, match="temperature 0 only"):
        cached.propose(target, tokens, context[:, 6:6], Sampler(temperature=1.0))


def test_init_drafter_of_the_other_kind_is_refused(run, tmp_path, capsys):
    argv = train_args(run / "target", run / "chat.jsonl", tmp_path / "again", max_steps=1,
                      init_drafter=run / "run" / "drafter", drafter_layers=2)
    assert train_main(argv) == ConfigError.exit_code
    assert "is a dflash2 drafter and --drafter-kind is dflash; pass --drafter-kind dflash2" in capsys.readouterr().err
