"""`dflash-eval`'s cache, temperature and seed flags, their defaults in --help, and its exit codes."""

from __future__ import annotations

import json

import pytest

from dflash.cli import eval_main, eval_parser
from dflash.io.drafter_dir import save_drafter
from dflash.decode.evaluate import untrained_drafter
from dflash.model.target import Target
from tests.support.dflash_train_fixtures import save_chat_target, write_chat_jsonl


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-eval")
    target_dir = save_chat_target(root / "target")
    drafter = untrained_drafter(Target.load(target_dir), block_size=4, num_hidden_layers=1)
    save_drafter(drafter, root / "drafter", dtype=None)
    return target_dir, root / "drafter", write_chat_jsonl(root / "chat.jsonl", n=6)


def _argv(tiny, *extra):
    target, drafter, data = tiny
    return ["--target", str(target), "--drafter", str(drafter), "--data", str(data), "--limit", "2",
            "--max-new-tokens", "5", "--device", "cpu", "--no-baselines", "--json", *extra]


def test_help_shows_the_new_flags_with_defaults():
    text = " ".join(eval_parser().format_help().split())
    for shown in ("--cache, --no-cache", "(default: True)", "--temperature TEMPERATURE", "(default: 0.0)",
                  "--seed SEED"):
        assert shown in text, shown


@pytest.mark.parametrize("flag, mode", [("--cache", "on"), ("--no-cache", "off")])
def test_eval_reports_speedup_beside_greedy(tiny, capsys, flag, mode):
    assert eval_main(_argv(tiny, flag)) == 0
    report = json.loads(capsys.readouterr().out)["drafter"]
    assert report["cache"] == mode and report["lossless"] is True and report["temperature"] == 0.0
    assert report["greedy_tokens_per_s"] > 0 and report["speedup"] == pytest.approx(
        report["tokens_per_s"] / report["greedy_tokens_per_s"])


def test_eval_samples_at_a_temperature(tiny, capsys):
    assert eval_main(_argv(tiny, "--temperature", "0.8", "--seed", "3")) == 0
    report = json.loads(capsys.readouterr().out)["drafter"]
    assert report["lossless"] is None and report["temperature"] == 0.8 and report["n_tokens"] > 0


def test_bad_flags_exit_with_the_option_error_code(tiny, capsys):
    assert eval_main(_argv(tiny, "--temperature", "-1")) == 2
    assert "--temperature -1.0 is negative" in capsys.readouterr().err
    assert eval_main(_argv(tiny, "--max-new-tokens", "0")) == 2


def test_a_prompt_beyond_the_context_exits_with_the_data_code(tiny, capsys):
    limit = Target.load(tiny[0]).config.max_position_embeddings
    assert eval_main(_argv(tiny, "--max-new-tokens", str(limit))) == 6
    assert "exceed the target's context" in capsys.readouterr().err
