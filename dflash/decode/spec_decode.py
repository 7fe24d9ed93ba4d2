"""Speculative decoding with a drafter, and plain decoding of the target alone (the baseline).

One step (block size bs, anchor = the last accepted token, not yet seen by the target):

    ids      p0 p1 ... p(a-1) | x_a                 x_a = anchor at position a
    drafter  proposes d1 .. d(bs-1) for positions a+1 .. a+bs-1 from context(< a) and the block
    target   one forward over [x_a, d1 .. d(bs-1)]  ->  p_k = target's distribution for position a+k
    accept   a prefix d1..dn (rule below), then one token from the target itself  =>  n+1 tokens
    rollback the target's cache keeps x_a, d1..dn (dflash.decode.target_state: exact for GatedDeltaNet too)

tau = mean tokens per verify step (1 <= tau <= bs). Both decoders run the target either with its caches
(`use_cache=True`: each forward feeds only the new tokens) or without (every forward re-runs the whole
sequence: exact for any target, slow); a target whose cache cannot be rolled back exactly runs uncached.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from collections.abc import Callable, Iterable

import torch

from dflash.decode.proposers import Draft, Sampler, as_proposer
from dflash.decode.target_state import TargetCache


@dataclass
class SpecResult:
    tokens: list[int]                                   # generated tokens (prompt excluded)
    accept_lengths: list[int] = field(default_factory=list)  # tokens gained per verify step, 1..bs
    verify_steps: int = 0
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / self.verify_steps if self.verify_steps else 0.0


class FullRecompute:
    """TargetCache's interface without a cache: every forward re-runs the target over the whole sequence."""

    def __init__(self, target):
        self.target, self.ids, self._last_fed = target, [], 0

    def forward(self, ids: list[int], rollback_ready: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        self.ids += ids
        self._last_fed = len(ids)
        last, context = self.target.forward_cached(torch.tensor([self.ids], device=self.target.device))
        return last[:, -len(ids):], context[:, -len(ids):]

    def rollback(self, keep: int) -> None:
        del self.ids[len(self.ids) - self._last_fed + keep:]
        self._last_fed = keep


def target_runner(target, use_cache: bool):
    """A TargetCache for one sequence when asked for and possible, else FullRecompute."""
    return (TargetCache.create(target) if use_cache else None) or FullRecompute(target)


def _cut_at_stop(tokens: list[int], stop: set[int]) -> tuple[list[int], bool]:
    for i, tok in enumerate(tokens):
        if tok in stop:
            return tokens[:i + 1], True
    return tokens, False


def accept_greedy(draft: list[int], target_tokens: list[int]) -> tuple[int, int]:
    """(n, next): n = length of the longest prefix of `draft` equal to the target's own argmax tokens
    (target_tokens[k] is its token for draft position k, k = 0..bs-1), next = target_tokens[n]."""
    n = 0
    # Keep d_k only where it equals what the target itself would emit: every output token is the
    # target's greedy token, so the output is exactly greedy decoding.
    while n < len(draft) and draft[n] == target_tokens[n]:
        n += 1
    # The target's token right after the accepted prefix is correct by construction: a free "bonus".
    return n, target_tokens[n]


def accept_sampled(draft: Draft, p: torch.Tensor, generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023). p [bs,V]: the target's
    probabilities for draft positions 0..bs-2 and the one after. Returns (n accepted, next token);
    each emitted token is distributed exactly as sampling from the target would give."""
    p = p.float().cpu()
    for k, x in enumerate(draft.tokens):
        q = draft.probs[k] if draft.probs is not None else torch.nn.functional.one_hot(
            torch.tensor(x), p.shape[-1]).float()                 # a point mass on x (a baseline's guess)
        # Accept x with probability min(1, p(x) / q(x)) ...
        if torch.rand((), generator=generator) < torch.clamp(p[k, x] / q[x], max=1.0):
            continue
        # ... else emit a sample of norm(max(0, p - q)): the part of p that q under-proposed. Together
        # the two branches give P(token) = min(p, q) + (1 - sum min(p, q)) * norm(max(0, p - q)) = p.
        residual = torch.clamp(p[k] - q, min=0.0)
        if residual.sum() <= 0:                                   # p == q up to rounding: p itself
            residual = p[k]
        return k, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    # Every draft token accepted: the next one comes from the target's distribution after the block.
    return len(draft.tokens), int(torch.multinomial(p[-1], 1, generator=generator))


@torch.no_grad()
def target_generate(target, prompt_ids: list[int], max_new_tokens: int, stop_token_ids: Iterable[int] = (),
                    *, use_cache: bool = True, sampler: Sampler | None = None,
                    on_step: Callable[[int, int, torch.Tensor], None] | None = None) -> list[int]:
    """Plain decoding by the target alone, one token per forward (greedy at temperature 0).
    on_step(position, token, logits [V]) sees each pick and the logits it came from (dflash.decode.lossless)."""
    sampler, stop, runner = sampler or Sampler(), set(stop_token_ids), target_runner(target, use_cache)
    tokens, feed = [], list(prompt_ids)
    while len(tokens) < max_new_tokens:
        last, _ = runner.forward(feed)
        logits = target.lm_head(last[0, -1:])                                       # [1,V]
        tokens.append(int(sampler.pick(logits)[0]))
        if on_step is not None:
            on_step(len(tokens) - 1, tokens[-1], logits[0])
        if tokens[-1] in stop:
            break
        feed = tokens[-1:]
    return tokens


def greedy_generate(target, prompt_ids: list[int], max_new_tokens: int, stop_token_ids: Iterable[int] = (),
                    *, use_cache: bool = True) -> list[int]:
    """Greedy decoding: target_generate at temperature 0."""
    return target_generate(target, prompt_ids, max_new_tokens, stop_token_ids, use_cache=use_cache)


@torch.no_grad()
def speculative_generate(target, drafter, prompt_ids: list[int], max_new_tokens: int,
                         stop_token_ids: Iterable[int] = (), *,
                         use_cache: bool = True, sampler: Sampler | None = None) -> SpecResult:
    """Generate up to max_new_tokens with `drafter` proposing and `target` verifying.
    Temperature 0 (the default): the output equals greedy decoding token for token."""
    proposer = as_proposer(drafter, incremental=use_cache)
    sampler, stop, ids = sampler or Sampler(), set(stop_token_ids), list(prompt_ids)
    if max_new_tokens <= 0:
        return SpecResult(tokens=[])
    if not ids:
        raise ValueError("prompt_ids is empty; speculative decoding needs at least one prompt token")
    if hasattr(proposer, "begin"):
        proposer.begin()
    start = time.perf_counter()
    runner = target_runner(target, use_cache)

    # Prefill: the target's next token becomes the first anchor; its pass gives the prompt's context.
    last, new_context = runner.forward(ids)
    ids.append(int(sampler.pick(target.lm_head(last[0, -1:]))[0]))
    result = SpecResult(tokens=[])
    done = ids[-1] in stop

    while not done and len(ids) - len(prompt_ids) < max_new_tokens:
        draft = proposer.propose(target, ids, new_context, sampler)
        draft = draft if isinstance(draft, Draft) else Draft(list(draft))
        # Verify: one target pass over the anchor + the whole draft; logits[k] is for draft position k.
        last, context = runner.forward(ids[-1:] + draft.tokens, rollback_ready=True)
        logits = target.lm_head(last[0])                                            # [bs,V]
        if sampler.temperature <= 0:
            n, following = accept_greedy(draft.tokens, logits.argmax(-1).tolist())
        else:
            n, following = accept_sampled(draft, sampler.probs(logits), sampler.generator)
        gained, done = _cut_at_stop(draft.tokens[:n] + [following], stop)
        ids += gained
        result.accept_lengths.append(n + 1)
        result.verify_steps += 1
        if not done and len(ids) - len(prompt_ids) < max_new_tokens:
            runner.rollback(n + 1)              # the target keeps the anchor + d1..dn
            new_context = context[:, :n + 1]    # their tapped states: causal, so free of the rejected tail

    result.tokens = ids[len(prompt_ids):][:max_new_tokens]
    result.seconds = time.perf_counter() - start
    return result
