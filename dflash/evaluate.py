"""Speculative decoding with a drafter, greedy verification, and the numbers that judge a drafter.

One step (block size bs, anchor = the last accepted token, not yet seen by the target):

    ids      p0 p1 ... p(a-1) | x_a                 x_a = anchor at position a
    drafter  proposes d1 .. d(bs-1) for positions a+1 .. a+bs-1 from context(< a) and the block
    target   one forward over ids + d  ->  g_k = target's greedy token for position a+k, k = 1..bs
    accept   d1..dn where d_k == g_k for every k <= n, then g_(n+1) for free ("bonus")  => n+1 tokens

Every emitted token is a token the target itself chose (d_k is kept only where it equals g_k), so the
output is exactly greedy decoding: lossless. tau = mean tokens per verify step (1 <= tau <= bs).

No KV cache: each verify step re-runs the target over the whole sequence. It is simple and exact for
hybrid targets too (a GatedDeltaNet state cannot be "cropped" back after a rejection), and the same pass
yields the tapped hidden states the drafter needs for the next step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch
from tqdm import tqdm

from dflash.model import Drafter, DrafterConfig


@dataclass
class SpecResult:
    tokens: list[int]                                   # generated tokens (prompt excluded), == greedy
    accept_lengths: list[int] = field(default_factory=list)  # tokens gained per verify step, 1..bs
    verify_steps: int = 0
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / self.verify_steps if self.verify_steps else 0.0


class Proposer(Protocol):
    """Anything that guesses the bs-1 tokens after the anchor (a drafter, a baseline, an oracle)."""

    block_size: int

    def propose(self, target, token_ids: list[int], context: torch.Tensor) -> list[int]:
        """token_ids: accepted tokens, the last one is the anchor; context [1,len-1,k*H] for positions
        before the anchor. Returns block_size-1 token ids."""


class DrafterProposer:
    """A trained (or untrained) Drafter as a Proposer: one drafter pass per block."""

    def __init__(self, drafter: Drafter, block_size: int | None = None):
        self.drafter = drafter.eval()
        self.block_size = block_size or drafter.config.block_size
        if self.block_size != drafter.config.block_size:
            # The drafter learned its masked positions for one block size; another size is a silent mismatch.
            raise ValueError(f"block_size {self.block_size} differs from the drafter's trained "
                             f"block_size {drafter.config.block_size}; leave block_size unset")

    @torch.no_grad()
    def propose(self, target, token_ids: list[int], context: torch.Tensor) -> list[int]:
        anchor = len(token_ids) - 1
        block = torch.tensor([[token_ids[-1]] + [target.mask_token_id] * (self.block_size - 1)],
                             device=target.device)
        anchors = torch.tensor([[anchor]], device=target.device)
        hidden = self.drafter(context, target.embed(block), anchors)          # [1,bs,H]
        logits = target.lm_head(hidden[:, 1:].to(target.dtype))               # [1,bs-1,V]
        return logits.argmax(-1)[0].tolist()


class RepeatLastProposer:
    """Baseline: guess that the anchor token repeats bs-1 times (what a drafter must clearly beat)."""

    def __init__(self, block_size: int = 16):
        self.block_size = block_size

    def propose(self, target, token_ids: list[int], context: torch.Tensor) -> list[int]:
        return [token_ids[-1]] * (self.block_size - 1)


def as_proposer(drafter, block_size: int | None = None) -> Proposer:
    if isinstance(drafter, Drafter):
        return DrafterProposer(drafter, block_size)
    if hasattr(drafter, "propose") and hasattr(drafter, "block_size"):
        return drafter
    raise TypeError(f"expected a Drafter or a proposer (.propose, .block_size), got {type(drafter).__name__}")


def _cut_at_stop(tokens: list[int], stop: set[int]) -> tuple[list[int], bool]:
    for i, tok in enumerate(tokens):
        if tok in stop:
            return tokens[:i + 1], True
    return tokens, False


def greedy_generate(target, prompt_ids: list[int], max_new_tokens: int,
                    stop_token_ids: Iterable[int] = ()) -> list[int]:
    """Plain greedy decoding, one full target forward per token (the same numerics as verification)."""
    stop, ids = set(stop_token_ids), list(prompt_ids)
    for _ in range(max_new_tokens):
        argmax, _ = target.greedy_next(torch.tensor([ids], device=target.device))
        ids.append(int(argmax[0, -1]))
        if ids[-1] in stop:
            break
    return ids[len(prompt_ids):]


@torch.no_grad()
def speculative_generate(target, drafter, prompt_ids: list[int], max_new_tokens: int,
                         block_size: int | None = None, stop_token_ids: Iterable[int] = ()) -> SpecResult:
    """Generate up to max_new_tokens with `drafter` proposing and `target` verifying; output == greedy."""
    proposer = as_proposer(drafter, block_size)
    stop, ids = set(stop_token_ids), list(prompt_ids)
    if max_new_tokens <= 0:
        return SpecResult(tokens=[])
    if not ids:
        raise ValueError("prompt_ids is empty; speculative decoding needs at least one prompt token")
    start = time.perf_counter()

    # Prefill: the target's next token becomes the first anchor; its pass gives context for the prompt.
    argmax, context = target.greedy_next(torch.tensor([ids], device=target.device))
    ids.append(int(argmax[0, -1]))
    result = SpecResult(tokens=[])
    done = ids[-1] in stop

    while not done and len(ids) - len(prompt_ids) < max_new_tokens:
        anchor = len(ids) - 1
        draft = proposer.propose(target, ids, context[:, :anchor])
        # Verify: one target pass over accepted tokens + the whole draft.
        argmax, context = target.greedy_next(torch.tensor([ids + draft], device=target.device))
        # greedy[k] is the target's own token for position anchor+1+k (k = 0..bs-1).
        greedy = argmax[0, anchor:anchor + len(draft) + 1].tolist()
        # Accept the longest prefix of the draft that the target would have produced itself ...
        n = 0
        while n < len(draft) and draft[n] == greedy[n]:
            n += 1
        # ... plus the target's token right after it: correct by construction, so it is free.
        gained, done = _cut_at_stop(draft[:n] + [greedy[n]], stop)
        ids += gained
        result.accept_lengths.append(n + 1)
        result.verify_steps += 1
        # `context` now covers ids + draft; positions < the new anchor hold only accepted tokens, and
        # causality makes their hidden states independent of the rejected tail, so it is reused as is.

    result.tokens = ids[len(prompt_ids):][:max_new_tokens]
    result.seconds = time.perf_counter() - start
    return result


def _default_stops(target) -> list[int]:
    eos = getattr(target.tokenizer, "eos_token_id", None)
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def evaluate(target, drafter, prompts: list[list[int]], max_new_tokens: int, *, block_size: int | None = None,
             stop_token_ids: Iterable[int] | None = None, check_lossless: bool = True,
             progress: bool = False) -> dict:
    """Speculative decoding over `prompts`: tau, throughput, and whether every output equals greedy.

    Returns {"tau", "tokens_per_s", "lossless", "n_prompts", "n_tokens", "verify_steps",
             "accept_histogram" (count per accepted length 1..bs), "greedy_tokens_per_s", "speedup",
             "mismatched_prompts" (indices whose output differed from greedy)}.
    Generation stops at the tokenizer's EOS unless stop_token_ids says otherwise.
    """
    proposer = as_proposer(drafter, block_size)
    stops = _default_stops(target) if stop_token_ids is None else list(stop_token_ids)
    accepted, steps, tokens, spec_s, greedy_s = 0, 0, 0, 0.0, 0.0
    histogram = [0] * proposer.block_size
    mismatched = []
    for i, prompt in enumerate(tqdm(prompts, desc="evaluate", disable=not progress, unit="prompt")):
        spec = speculative_generate(target, proposer, prompt, max_new_tokens, stop_token_ids=stops)
        accepted, steps, tokens = accepted + sum(spec.accept_lengths), steps + spec.verify_steps, tokens + len(spec.tokens)
        spec_s += spec.seconds
        for length in spec.accept_lengths:
            histogram[length - 1] += 1
        if check_lossless:
            t0 = time.perf_counter()
            if greedy_generate(target, prompt, max_new_tokens, stops) != spec.tokens:
                mismatched.append(i)
            greedy_s += time.perf_counter() - t0
    report = {
        "tau": accepted / steps if steps else 0.0,
        "tokens_per_s": tokens / spec_s if spec_s else 0.0,
        "lossless": not mismatched if check_lossless else None,
        "n_prompts": len(prompts), "n_tokens": tokens, "verify_steps": steps,
        "accept_histogram": histogram, "mismatched_prompts": mismatched,
    }
    if check_lossless and greedy_s:
        report["greedy_tokens_per_s"] = tokens / greedy_s
        report["speedup"] = report["tokens_per_s"] / report["greedy_tokens_per_s"]
    return report


def load_for_eval(target_dir, drafter_dir, device="cpu", target_dtype=torch.float32):
    """(Target, Drafter) for evaluating the drafter in `drafter_dir` (the reference DFlash layout: one
    written by dflash-train, or a published one) on the target in `target_dir`.

    Everything is checked before a weight is read: the drafter's config.json and tensor names, then
    its fit to the target's config.json (hidden size, layer count, tapped ids, vocabulary, mask token);
    the target is then tapped at the drafter's layers with its mask token. A drafter that names the
    target it was trained for (target_fingerprint) must name this one. On a CPU, bf16 weights are
    upcast to float32 (dflash.drafter_io.load_drafter says so in the log).
    """
    from dflash.drafter_io import check_fits_target, load_drafter, read_drafter_config, target_shape
    from dflash.target import Target

    config = read_drafter_config(drafter_dir)
    where = f"the drafter in {drafter_dir}"
    check_fits_target(config, target_shape(target_dir), where)
    target = Target.load(target_dir, device=device, dtype=target_dtype, layer_ids=config.target_layer_ids,
                         mask_token=config.mask_token_id)
    check_fits_target(config, target, where)
    return target, load_drafter(drafter_dir, device=device).eval()


def untrained_drafter(target, config: DrafterConfig | None = None, seed: int = 0, **overrides) -> Drafter:
    """A freshly initialised drafter shaped like the trained one (without touching the global RNG)."""
    config = config or DrafterConfig.from_target(target, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = Drafter(config)
    return drafter.to(device=target.device, dtype=target.dtype)


def evaluate_baseline(target, prompts: list[list[int]], max_new_tokens: int, kind: str = "repeat_last", *,
                      block_size: int = 16, config: DrafterConfig | None = None, seed: int = 0,
                      **kwargs) -> dict:
    """evaluate() for a baseline: "repeat_last" (anchor repeated) or "untrained" (a fresh drafter)."""
    if kind == "repeat_last":
        proposer = RepeatLastProposer(config.block_size if config else block_size)
    elif kind == "untrained":
        proposer = DrafterProposer(untrained_drafter(target, config, seed, block_size=block_size)
                                   if config is None else untrained_drafter(target, config, seed))
    else:
        raise ValueError(f"unknown baseline {kind!r}; choose 'repeat_last' or 'untrained'")
    return evaluate(target, proposer, prompts, max_new_tokens, **kwargs)


def format_results(results: dict[str, dict]) -> str:
    """A small table: one row per method, tau / tokens per second / lossless."""
    rows = [f"{'method':<20} {'tau':>6} {'tokens/s':>10} {'lossless':>9}"]
    for name, r in results.items():
        rows.append(f"{name:<20} {r['tau']:>6.2f} {r['tokens_per_s']:>10.1f} {str(r.get('lossless', '-')):>9}")
    return "\n".join(rows)
