"""Temperature > 0: speculative sampling is lossless in distribution.

Sampled outputs cannot be compared token by token, so each test draws many seeded samples and compares
their empirical distribution with the exact one by Pearson's chi-square test (bins expecting fewer than
5 counts merged into one), failing below p = 1e-3. The seeds are fixed, so a test's outcome is
deterministic; a correct rule passes with 99.9 % probability over seeds, and the negative controls show
that a wrong rule (always accepting the draft) fails by a wide margin at the same sample sizes.
"""

import torch

from dflash.decode.proposers import Draft, Sampler
from dflash.decode.spec_decode import accept_sampled, speculative_generate
from dflash.model.target import Target
from tests.support.dflash_tiny import save_tiny_target

ALPHA = 1e-3


def chi_square_p(samples: list[int], probs: torch.Tensor) -> float:
    """p-value of `samples` being drawn from `probs` [V] (Pearson chi-square, small bins merged)."""
    n = len(samples)
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    expected = probs.double() * n
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum().view(1)])
    wanted = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = wanted > 0
    observed, wanted = observed[keep], wanted[keep]
    stat = ((observed - wanted) ** 2 / wanted).sum()
    dof = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def _rule_samples(p, q, n, seed, point_mass=None):
    """First and second emitted token of `n` steps of the rule with drafts drawn from q (or a point mass)."""
    g = torch.Generator().manual_seed(seed)
    first, second, drafted = [], [], []
    for _ in range(n):
        if point_mass is None:
            tokens = [int(torch.multinomial(q[k], 1, generator=g)) for k in range(q.shape[0])]
            draft = Draft(tokens, q)
        else:
            draft = Draft([point_mass] * (p.shape[0] - 1))
        accepted, following = accept_sampled(draft, p, g)
        emitted = draft.tokens[:accepted] + [following]
        first.append(emitted[0])
        drafted.append(draft.tokens[0])
        if len(emitted) > 1 and emitted[0] == draft.tokens[0]:
            second.append(emitted[1])
    return first, second, drafted


def _tables(seed=0, v=6, k=2):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, v, generator=g) * 1.5, -1)   # the target: p[k] for draft position k
    q = torch.softmax(torch.randn(k, v, generator=g) * 1.5, -1)       # the drafter, deliberately different
    return p, q


def test_the_rule_emits_the_target_distribution():
    """Token 1 ~ p[0]; token 2, given that token 1 was the accepted draft, ~ p[1] (p[1] stands for the
    target's distribution after that draft token). Always accepting the draft (a wrong rule) gives q[0]."""
    p, q = _tables()
    first, second, drafted = _rule_samples(p, q, 8000, seed=1)
    assert chi_square_p(first, p[0]) > ALPHA
    assert chi_square_p(second, p[1]) > ALPHA and len(second) > 1000
    assert chi_square_p(drafted, p[0]) < 1e-9  # negative control: the draft alone is not the target


def test_a_point_mass_guess_is_corrected_to_the_target_distribution():
    """A baseline's guess (q = a point mass on one token) is accepted with probability p(x); the
    residual norm(max(0, p - onehot)) covers the rest."""
    p, _ = _tables(seed=2)
    first, _, _ = _rule_samples(p, None, 6000, seed=3, point_mass=int(p[0].argmax()))
    assert chi_square_p(first, p[0]) > ALPHA


class HalfOracle:
    """Draft token 1 from q = 0.5 * (the target's true next-token distribution) + 0.5 * uniform, the rest
    uniform: accepted often, rejected often, so both branches of the rule run."""

    block_size = 3

    def propose(self, target, token_ids, new_context, sampler):
        last, _ = target.forward_cached(torch.tensor([token_ids]))
        true = sampler.probs(target.lm_head(last[0, -1]))
        uniform = torch.full_like(true, 1 / true.numel())
        q = torch.stack([0.5 * true + 0.5 * uniform, uniform, uniform])[:self.block_size - 1]
        tokens = [int(torch.multinomial(q[k], 1, generator=sampler.generator)) for k in range(q.shape[0])]
        return Draft(tokens, q)


def test_speculative_sampling_on_a_hybrid_target_matches_the_target(tmp_path_factory):
    """The second generated token (the first one a draft can supply) of many seeded runs on the tiny
    GatedDeltaNet hybrid at temperature 1, with its caches, against its exact marginal
    sum_t1 p(t1) p(t2 | t1) (the rule does not depend on the caches; the uncached path shares it)."""
    target = Target.load(save_tiny_target(tmp_path_factory.mktemp("hybrid"), "qwen3_5"))
    prompt = [5, 17, 42, 8]
    with torch.no_grad():
        last, _ = target.forward_cached(torch.tensor([prompt]))
        p1 = torch.softmax(target.lm_head(last[0, -1]).float(), -1)
        every_t1 = torch.tensor([prompt + [t] for t in range(target.vocab_size)])
        last, _ = target.forward_cached(every_t1)
        p2 = p1 @ torch.softmax(target.lm_head(last[:, -1]).float(), -1)      # [V]
    firsts, seconds = [], []
    for seed in range(300):
        sampler = Sampler(1.0, torch.Generator().manual_seed(seed))
        out = speculative_generate(target, HalfOracle(), prompt, 2, use_cache=True, sampler=sampler).tokens
        firsts.append(out[0])
        seconds.append(out[1])
    assert chi_square_p(firsts, p1) > ALPHA
    assert chi_square_p(seconds, p2) > ALPHA
