"""Speculative decoding is lossless whatever proposes, with the target's caches and without; tau is exact
for scripted proposers."""

import pytest
import torch

from dflash.decode.evaluate import (
    DrafterProposer, RepeatLastProposer, Sampler, evaluate, evaluate_baseline, greedy_generate, speculative_generate,
    untrained_drafter,
)
from dflash.model.target import Target
from tests.support.dflash_tiny import save_tiny_target

BS = 4
NEW = 12


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3"])
def target(request, tmp_path_factory):
    return Target.load(save_tiny_target(tmp_path_factory.mktemp(request.param), request.param))


@pytest.fixture(params=[True, False], ids=["cache", "no-cache"])
def use_cache(request):
    return request.param


def prompts(n=3, length=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 96, (n, length), generator=g).tolist()


class ScriptedProposer:
    """Proposes the target's greedy continuation, correct for the first `right` tokens, then wrong."""

    def __init__(self, block_size, right):
        self.block_size, self.right = block_size, right
        self.seen = 0

    def begin(self):
        self.seen = 0

    def propose(self, target, token_ids, new_context, sampler):
        self.seen += new_context.shape[1]
        assert self.seen == len(token_ids) - 1  # the context covers every position before the anchor
        guess = greedy_generate(target, token_ids, self.block_size - 1, use_cache=False)
        return guess[:self.right] + [(t + 1) % target.vocab_size for t in guess[self.right:]]


def test_oracle_gets_a_full_block_every_step(target, use_cache):
    prompt = prompts(1)[0]
    spec = speculative_generate(target, ScriptedProposer(BS, BS - 1), prompt, 1 + 3 * BS, use_cache=use_cache)
    assert spec.tokens == greedy_generate(target, prompt, 1 + 3 * BS, use_cache=False)
    assert spec.accept_lengths == [BS, BS, BS] and spec.tau == BS and spec.verify_steps == 3


@pytest.mark.parametrize("right", [0, 1, 2])
def test_accept_length_is_matching_prefix_plus_bonus(target, right, use_cache):
    """Every partial acceptance rolls the caches back; the output stays the uncached greedy one."""
    prompt = prompts(1, seed=right)[0]
    spec = speculative_generate(target, ScriptedProposer(BS, right), prompt, NEW, use_cache=use_cache)
    assert spec.tokens == greedy_generate(target, prompt, NEW, use_cache=False)
    assert spec.tokens == greedy_generate(target, prompt, NEW, use_cache=True)
    assert set(spec.accept_lengths) == {right + 1}


def test_random_drafters_are_lossless(target, use_cache):
    for seed in range(2):
        drafter = untrained_drafter(target, seed=seed, block_size=BS, num_hidden_layers=1)
        for prompt in prompts(2, seed=seed):
            spec = speculative_generate(target, drafter, prompt, NEW, use_cache=use_cache)
            assert spec.tokens == greedy_generate(target, prompt, NEW, use_cache=False)
            assert len(spec.tokens) == NEW and all(1 <= n <= BS for n in spec.accept_lengths)


def test_stop_token_ends_both_decoders_alike(target):
    prompt = prompts(1, seed=5)[0]
    full = greedy_generate(target, prompt, NEW)
    stop = full[4]
    expected = full[:full.index(stop) + 1]
    assert greedy_generate(target, prompt, NEW, [stop]) == expected
    assert speculative_generate(target, ScriptedProposer(BS, BS - 1), prompt, NEW, stop_token_ids=[stop]).tokens == expected


def test_repeat_last_baseline(target):
    proposer = RepeatLastProposer(BS)
    assert proposer.propose(target, [5, 9], torch.zeros(1, 1, 1), Sampler()) == [9, 9, 9]
    report = evaluate_baseline(target, prompts(), NEW, "repeat_last", block_size=BS, stop_token_ids=[])
    assert report["lossless"] is True and report["n_prompts"] == 3 and report["n_tokens"] == 3 * NEW
    assert 1 <= report["tau"] <= BS and sum(report["accept_histogram"]) == report["verify_steps"]


def test_evaluate_reports_oracle_tau_and_untrained_baseline(target, use_cache):
    report = evaluate(target, ScriptedProposer(BS, BS - 1), prompts(2), 1 + 2 * BS, stop_token_ids=[],
                      use_cache=use_cache)
    assert report["tau"] == BS and report["lossless"] and report["accept_histogram"] == [0, 0, 0, 4]
    assert report["cache"] == ("on" if use_cache else "off") and report["greedy_tokens_per_s"] > 0
    assert report["tokens_per_s"] > 0 and report["speedup"] > 0
    untrained = evaluate_baseline(target, prompts(2), NEW, "untrained", block_size=BS, stop_token_ids=[])
    assert untrained["lossless"] and 1 <= untrained["tau"] <= BS


def test_untrained_drafter_leaves_global_rng_alone(target):
    state = torch.random.get_rng_state()
    a = untrained_drafter(target, seed=3, block_size=BS)
    b = untrained_drafter(target, seed=3, block_size=BS)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_errors_are_named(target):
    assert DrafterProposer(untrained_drafter(target, block_size=BS)).block_size == BS  # the drafter's own
    with pytest.raises(ValueError, match="unknown baseline 'ngram'"):
        evaluate_baseline(target, prompts(), NEW, "ngram")
    with pytest.raises(TypeError, match="expected a Drafter or a proposer"):
        speculative_generate(target, object(), [5], 3)
