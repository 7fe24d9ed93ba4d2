"""The caches of speculative decoding: the target's rollback is exact (attention crop, GatedDeltaNet
restore + re-advance), the drafter's incremental context equals Drafter.forward, targets without an exact
rollback fall back to the uncached path and say so, and the demo target decodes losslessly."""

import pytest
import torch

from dflash.errors import DataError
from dflash.decode.evaluate import evaluate, greedy_generate, speculative_generate, untrained_drafter
from dflash.decode.proposers import DrafterContextCache
from dflash.model.target import Target
from dflash.decode.target_state import TargetCache
from tests.support.dflash_tiny import save_tiny_target

PROMPT = [5, 17, 42, 8, 63, 21, 9]
BLOCK = [33, 71, 12, 50, 6]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3"])
def target(request, tmp_path_factory):
    return Target.load(save_tiny_target(tmp_path_factory.mktemp(request.param), request.param))


def _states(cache: TargetCache) -> list[torch.Tensor]:
    """Every tensor the cache holds: keys/values of attention layers, conv/recurrent of GatedDeltaNet."""
    out = []
    for i, layer in enumerate(cache.cache.layers):
        if i in cache.linear_modules:
            out += [layer.conv_states[0], layer.recurrent_states[0]]
        else:
            out += [layer.keys, layer.values]
    return out


@pytest.mark.parametrize("keep", [0, 1, 3, len(BLOCK)])
def test_rollback_leaves_the_cache_of_the_kept_tokens(target, keep):
    """forward(block) then rollback(keep) == forward(block[:keep]) on a fresh cache, state by state,
    and the next token's hidden state matches a pass without any cache."""
    rolled, fresh = TargetCache.create(target), TargetCache.create(target)
    rolled.forward(PROMPT)
    rolled.forward(BLOCK, rollback_ready=True)
    rolled.rollback(keep)
    fresh.forward(PROMPT)
    if keep:
        fresh.forward(BLOCK[:keep])
    assert rolled.length == fresh.length == len(PROMPT) + keep
    for a, b in zip(_states(rolled), _states(fresh), strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    nxt = [77]
    last, context = rolled.forward(nxt)
    ref_last, ref_context = target.forward_cached(torch.tensor([PROMPT + BLOCK[:keep] + nxt]))
    torch.testing.assert_close(last[0, -1], ref_last[0, -1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(context[0, -1], ref_context[0, -1], rtol=1e-4, atol=1e-5)


def test_rollback_of_gated_deltanet_needs_the_saved_state(target):
    cache = TargetCache.create(target)
    cache.forward(PROMPT)
    cache.forward(BLOCK)
    if cache.linear_modules:
        with pytest.raises(RuntimeError, match="rollback_ready=True"):
            cache.rollback(2)
    else:
        cache.rollback(2)  # attention only: a crop needs nothing saved
        assert cache.length == len(PROMPT) + 2
    with pytest.raises(ValueError, match="keeps 9 of the last forward's"):
        cache.rollback(9)


@pytest.mark.parametrize("layer_types", [["full_attention"] * 2, ["sliding_attention", "full_attention"]])
def test_incremental_drafter_context_equals_drafter_forward(target, layer_types):
    drafter = untrained_drafter(target, block_size=4, num_hidden_layers=2, layer_types=layer_types,
                                sliding_window=3 if "sliding_attention" in layer_types else None)
    context = target.context(torch.tensor([PROMPT + BLOCK]))                       # [1,12,k*H]
    cache = DrafterContextCache(drafter)
    for start, stop in ((0, 7), (7, 8), (8, 11)):   # a prompt, then accepted runs of 1 and 3 tokens
        cache.extend(context[:, start:stop])
        block = target.embed(torch.tensor([[3] + [target.mask_token_id] * 3]))
        got = cache.block_hidden(block, anchor=stop)
        want = drafter(context[:, :stop], block, torch.tensor([[stop]]))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs exactly the positions before it"):
        cache.block_hidden(block, anchor=5)


def test_sliding_window_target_falls_back_to_the_uncached_path(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3Config

    from tests.support.dflash_tiny import build_tokenizer

    config = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_sliding_window=True,
                         sliding_window=4, max_window_layers=0, layer_types=["sliding_attention"] * 4,
                         pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    target = Target.load(tmp_path)
    assert "DynamicSlidingWindowLayer" in TargetCache.unsupported_reason(target)
    assert TargetCache.create(target) is None
    drafter = untrained_drafter(target, block_size=4, num_hidden_layers=1)
    report = evaluate(target, drafter, [PROMPT], 8, stop_token_ids=[])
    assert report["cache"].startswith("off (layer 0 has a DynamicSlidingWindowLayer cache")
    assert report["lossless"] is True


def test_prompt_longer_than_the_context_is_named(target):
    drafter = untrained_drafter(target, block_size=4, num_hidden_layers=1)
    limit = target.config.max_position_embeddings
    with pytest.raises(DataError, match=f"exceed the target's context of {limit} positions"):
        evaluate(target, drafter, [PROMPT, [5] * limit], 8)


def test_demo_target_decodes_losslessly_with_and_without_caches():
    """The pre-trained demo hybrid (6 GatedDeltaNet + 2 attention layers): a drafter that is right on
    a varying number of tokens (a noisy greedy oracle) gives every accept length, and the output is
    greedy decoding's, cached and uncached."""
    from dflash.demo.tiny_target import build_demo_target, default_demo_dir

    target = Target.load(build_demo_target(default_demo_dir(), progress=False))
    prompts = [target.tokenizer.encode(text) for text in ("The cat sat on", "Question: what is")]

    class NoisyOracle:
        block_size = 6

        def __init__(self):
            self.step = 0

        def propose(self, target, token_ids, new_context, sampler):
            self.step += 1
            guess = greedy_generate(target, token_ids, self.block_size - 1, use_cache=False)
            right = self.step % self.block_size               # 0..5 tokens right, then wrong ones
            return guess[:right] + [(t + 1) % target.vocab_size for t in guess[right:]]

    for prompt in prompts:
        want = greedy_generate(target, prompt, 24, use_cache=False)
        assert greedy_generate(target, prompt, 24, use_cache=True) == want
        for use_cache in (True, False):
            spec = speculative_generate(target, NoisyOracle(), prompt, 24, use_cache=use_cache)
            assert spec.tokens == want
            assert len(set(spec.accept_lengths)) >= 4
