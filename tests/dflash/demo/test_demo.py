"""dflash.demo: the demo target builds, is cached atomically, reloads as a real target, and has learned.

The full build (pre-training on CPU) runs once per session, where every demo run finds it
($DFLASH_DEMO_CACHE, else ~/.cache/dflash/demo), and is reused across sessions from there.
"""

from __future__ import annotations

import pytest

from dflash.demo.corpus import demo_conversations
from dflash.demo.tiny_target import (DemoSpec, answer_diversity, build_demo_target, default_demo_dir, probe_greedy,
                                     read_demo_record)
from dflash.model.target import Target


# the full build pre-trains for about a minute and a half of CPU time (once per session, or never with
# a warm DFLASH_DEMO_CACHE); tests that need it are marked slow
needs_build = pytest.mark.slow


@pytest.fixture(scope="session")
def demo_dir():
    """The demo target where every demo run of the test session finds it ($DFLASH_DEMO_CACHE, else
    ~/.cache/dflash/demo): the decoding tests and the in-process demo runs build or reuse the same one."""
    return build_demo_target(default_demo_dir(), progress=False)


@pytest.fixture(scope="session")
def target(demo_dir):
    return Target.load(demo_dir)


@needs_build
def test_reloads_as_a_hybrid_target(target, demo_dir):
    config = target.model.config
    assert config.model_type == "qwen3_5_text"
    assert {"linear_attention", "full_attention"} == set(config.layer_types)
    assert target.num_layers == DemoSpec().num_layers and len(target.layer_ids) == 5
    tok = target.tokenizer
    assert target.mask_token_id == tok.convert_tokens_to_ids("<|mask|>") < target.vocab_size
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    assert target.kernel_report()  # the GatedDeltaNet kernel functions are there to report on
    assert demo_dir.name == f"demo-target-{DemoSpec().key()}"


@needs_build
def test_greedy_answers_are_varied_and_learned(target, demo_dir):
    """Not one repeated token: the pre-trained target answers held-out prompts with varied text."""
    probe = probe_greedy(target.model, target.tokenizer)
    assert probe["distinct_tokens"] >= 40, probe
    assert probe["top_token_share"] < 0.25, probe
    assert probe["exact_match"] >= 0.15, probe  # it learned the templates, not just their words
    # the reloaded weights are the trained ones: the probe repeats the build's own record exactly
    assert probe == read_demo_record(demo_dir)["probe"]


@needs_build
def test_cache_is_reused(demo_dir):
    record = demo_dir / "demo.json"
    before = record.stat().st_mtime_ns
    assert build_demo_target(demo_dir.parent, progress=False) == demo_dir
    assert record.stat().st_mtime_ns == before


def test_incomplete_build_is_rebuilt(tmp_path):
    # pretrain_steps=0: the whole build path (tokenizer, model, probe, save, rename) without training
    path = build_demo_target(tmp_path, pretrain_steps=0, progress=False)
    assert read_demo_record(path)["spec"]["pretrain_steps"] == 0
    (path / "demo.json").unlink()  # as if the build died before its record was written
    assert build_demo_target(tmp_path, pretrain_steps=0, progress=False) == path
    assert read_demo_record(path) is not None
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary directories left behind


def test_default_cache_dir_follows_env(tmp_path, monkeypatch):
    from dflash.demo.tiny_target import default_demo_dir

    monkeypatch.setenv("DFLASH_DEMO_CACHE", str(tmp_path))
    assert default_demo_dir() == tmp_path


def test_spec_key_names_every_parameter():
    assert DemoSpec().key() == DemoSpec().key()
    assert DemoSpec(seed=1).key() != DemoSpec().key()
    assert DemoSpec(pretrain_steps=1).key() != DemoSpec().key()


def test_demo_conversations_are_deterministic_chat():
    convs = demo_conversations(10, seed=3)
    assert convs == demo_conversations(10, seed=3) and convs != demo_conversations(10, seed=4)
    assert all(c[-1]["role"] == "assistant" and c[0]["role"] == "user" for c in convs)
    assert {len(c) // 2 for c in convs} == {2, 3}  # two or three exchanges by default
    assert all(len(c) == 2 for c in demo_conversations(5, seed=3, turns=(1, 1)))
    with pytest.raises(ValueError, match="turns"):
        demo_conversations(1, turns=(2, 1))
    assert len({c[0]["content"].split()[0] for c in demo_conversations(200)}) >= 8  # many task kinds


def test_answer_diversity_measure():
    assert answer_diversity([[5, 5, 5], [5]]) == {"tokens": 4, "distinct_tokens": 1, "top_token_share": 1.0}
    assert answer_diversity([[1, 2], [3, 4]])["top_token_share"] == 0.25
