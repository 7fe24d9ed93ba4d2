"""The numbers that judge a drafter: tau, tokens/s against plain decoding, and losslessness.

`evaluate` runs each prompt twice, side by side under the same conditions: speculative decoding
(dflash.decode.spec_decode, the drafter proposing, the target verifying) and plain decoding by the target
alone, both with the target's caches (dflash.decode.target_state) unless use_cache=False. speed-up = spec
tokens/s / plain tokens/s. At temperature 0 the two outputs must be equal token for token ("lossless"),
except where they first differ at a near-tie: the target's logits for the two tokens within its dtype's
rounding there, which a verify pass and a one-token forward can break differently (dflash.decode.lossless
states the rule and its tolerance; such prompts are counted as "near_ties" and do not fail). At
temperature > 0 they are samples and cannot be compared one by one: the speculative-sampling rule is
lossless in distribution, which tests/test_spec_sampling.py checks on a small vocabulary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch
from tqdm import tqdm

from dflash.errors import DataError
from dflash.model.drafter import Drafter, DrafterConfig
from dflash.kinds import build_drafter
from dflash.decode.proposers import (  # noqa: F401  (re-exported: the names callers import from here)
    Draft, DrafterProposer, Proposer, RepeatLastProposer, Sampler, as_proposer,
)
from dflash.decode.lossless import NEAR_TIE_ULPS, DivergenceWatch, describe
from dflash.decode.spec_decode import (  # noqa: F401
    SpecResult, greedy_generate, speculative_generate, target_generate,
)
from dflash.decode.target_state import TargetCache

log = logging.getLogger(__name__)


def _default_stops(target) -> list[int]:
    eos = getattr(target.tokenizer, "eos_token_id", None)
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def check_prompt_lengths(target, prompts: list[list[int]], max_new_tokens: int, block_size: int) -> None:
    """Raise DataError when a prompt plus its new tokens (and one block) exceeds the target's context."""
    limit = getattr(target.config, "max_position_embeddings", None)
    if not limit:
        return
    too_long = [i for i, p in enumerate(prompts) if len(p) + max_new_tokens + block_size > limit]
    if too_long:
        longest = max(len(prompts[i]) for i in too_long)
        raise DataError(f"{len(too_long)} prompt(s) (first: #{too_long[0]}, longest {longest} tokens) plus "
                        f"--max-new-tokens {max_new_tokens} and a block of {block_size} exceed the target's "
                        f"context of {limit} positions (max_position_embeddings); lower --max-new-tokens or "
                        "drop the longest prompts")


def cache_mode(target, use_cache: bool) -> str:
    """"on", "off", or "off (why)" when the target's cache cannot be rolled back exactly."""
    if not use_cache:
        return "off"
    reason = TargetCache.unsupported_reason(target)
    if reason is None:
        return "on"
    log.warning("no exact cache rollback for this target (%s): evaluating on the exact uncached path", reason)
    return f"off ({reason})"


def evaluate(target, drafter, prompts: list[list[int]], max_new_tokens: int, *,
             stop_token_ids: Iterable[int] | None = None, check_lossless: bool = True, progress: bool = False,
             use_cache: bool = True, temperature: float = 0.0, seed: int = 0) -> dict:
    """Speculative decoding over `prompts` beside plain decoding by the target: tau, throughput, speed-up,
    and (temperature 0) whether every output equals greedy decoding.

    Returns {"tau", "tokens_per_s", "lossless" (True: every output equals greedy decoding or first differs
             from it at a near-tie; False: one differs at a clear margin; None at temperature > 0 or
             unchecked), "near_ties" (prompts that first differed at a near-tie; None where lossless is),
             "divergences" (per differing prompt: {"prompt", "position", "greedy_token", "spec_token",
             "margin", "tolerance", "near_tie"}, dflash.decode.lossless), "mismatched_prompts" (indices
             whose output differed from greedy, near-ties included), "n_prompts", "n_tokens",
             "verify_steps", "accept_histogram" (count per accepted length 1..bs), "cache" ("on", "off",
             "off (why)"), "temperature", "target_dtype", and with check_lossless: "greedy_tokens_per_s"
             (plain decoding by the target, greedy or sampled at the same temperature) and "speedup"}.
    check_lossless=False skips the plain decoding. Generation stops at the tokenizer's EOS unless
    stop_token_ids says otherwise. Prompt i samples with torch.Generator seeded seed + i.
    """
    proposer = as_proposer(drafter, incremental=use_cache)
    stops = _default_stops(target) if stop_token_ids is None else list(stop_token_ids)
    check_prompt_lengths(target, prompts, max_new_tokens, proposer.block_size)
    mode = cache_mode(target, use_cache)
    cached = mode == "on"

    def sampler(i):
        return Sampler(temperature, torch.Generator().manual_seed(seed + i) if temperature > 0 else None)

    if prompts:  # warm-up, untimed: the first pass of each path pays one-time allocations and dispatch
        _warm_up(target, proposer, prompts[0], cached, check_lossless, sampler)
    accepted, steps, tokens, plain_tokens, spec_s, plain_s = 0, 0, 0, 0, 0.0, 0.0
    histogram = [0] * proposer.block_size
    divergences = []
    judged = check_lossless and temperature <= 0
    for i, prompt in enumerate(tqdm(prompts, desc="evaluate", disable=not progress, unit="prompt")):
        spec = speculative_generate(target, proposer, prompt, max_new_tokens, stop_token_ids=stops,
                                    use_cache=cached, sampler=sampler(i))
        accepted, steps = accepted + sum(spec.accept_lengths), steps + spec.verify_steps
        tokens += len(spec.tokens)
        spec_s += spec.seconds
        for length in spec.accept_lengths:
            histogram[length - 1] += 1
        if check_lossless:
            n_plain, seconds, divergence = _decode_plain(target, prompt, i, max_new_tokens, stops, cached, sampler,
                                                         spec.tokens if judged else None)
            plain_s, plain_tokens = plain_s + seconds, plain_tokens + n_plain
            if divergence is not None:
                divergences.append(divergence)
    report = {
        "tau": accepted / steps if steps else 0.0,
        "tokens_per_s": tokens / spec_s if spec_s else 0.0,
        **_lossless_fields(divergences, judged),
        "n_prompts": len(prompts), "n_tokens": tokens, "verify_steps": steps,
        "accept_histogram": histogram, "accept_per_pos": acceptance_per_position(histogram),
        "cache": mode, "temperature": temperature,
        "target_dtype": str(getattr(target, "dtype", "")).removeprefix("torch."),
    }
    if check_lossless and plain_s:
        report["greedy_tokens_per_s"] = plain_tokens / plain_s
        report["speedup"] = report["tokens_per_s"] / report["greedy_tokens_per_s"]
    return report


def _warm_up(target, proposer: Proposer, prompt: list[int], cached: bool, plain: bool, sampler) -> None:
    """One untimed two-token pass of speculative decoding (and, with `plain`, of plain decoding) on `prompt`."""
    speculative_generate(target, proposer, prompt, 2, use_cache=cached, sampler=sampler(0))
    if plain:
        target_generate(target, prompt, 2, use_cache=cached, sampler=sampler(0))


def _decode_plain(target, prompt: list[int], i: int, max_new_tokens: int, stops: list[int], cached: bool, sampler,
                  spec_tokens: list[int] | None) -> tuple[int, float, dict | None]:
    """Plain decoding of prompt i by the target, timed: (tokens, seconds, where it first differs from
    `spec_tokens` or None; spec_tokens None: not compared)."""
    watch = DivergenceWatch(spec_tokens, getattr(target, "dtype", None)) if spec_tokens is not None else None
    t0 = time.perf_counter()
    plain = target_generate(target, prompt, max_new_tokens, stops, use_cache=cached, sampler=sampler(i),
                            on_step=watch)
    seconds = time.perf_counter() - t0
    if watch is not None and (found := watch.finish(plain)) is not None:
        return len(plain), seconds, {"prompt": i, **found}
    return len(plain), seconds, None


def _lossless_fields(divergences: list[dict], judged: bool) -> dict:
    """The report's verdict: lossless, near_ties (None unless judged), divergences, mismatched_prompts."""
    return {
        "lossless": all(d["near_tie"] for d in divergences) if judged else None,
        "near_ties": sum(d["near_tie"] for d in divergences) if judged else None,
        "divergences": divergences, "mismatched_prompts": [d["prompt"] for d in divergences],
    }


def acceptance_per_position(histogram: list[int]) -> list[float]:
    """[bs-1] from the count of verify steps per accepted length 1..bs: at draft position k, the share of
    the steps that reached k (accepted k-1 drafts) that accepted it too (0.0 where none reached k)."""
    reached = [sum(histogram[k:]) for k in range(len(histogram))]
    return [round(reached[k + 1] / reached[k], 4) if reached[k] else 0.0 for k in range(len(histogram) - 1)]


def check_for_eval(target_dir, drafter_dir) -> tuple[DrafterConfig, list[str]]:
    """(the drafter's config, warnings) from config.json and the safetensors headers alone: no weight is
    read. Raises DrafterError for a drafter this project cannot run on this target (config.json, tensor
    names, shapes and dtypes; its fit to the target's config.json: hidden size, layer count, tapped ids,
    vocabulary). Warns where an engine would not serve it: a tapped id on the target's last layer, which
    vLLM captures as this evaluation does but SGLang refuses (dflash.io.engines.last_layer_problem), so the
    numbers hold for vLLM only; evaluating such a drafter (a third party's, for vLLM) is still useful."""
    from dflash.io.drafter_dir import read_drafter_config
    from dflash.io.engines import last_layer_problem
    from dflash.io.fit import check_fits_target, target_shape

    config = read_drafter_config(drafter_dir)
    shape = target_shape(target_dir)
    check_fits_target(config, shape, f"the drafter in {drafter_dir}")
    warnings = []
    if problem := last_layer_problem(config.target_layer_ids, shape.num_layers):
        warnings.append(f"the drafter in {drafter_dir} taps {config.target_layer_ids}, which SGLang cannot serve: "
                        f"{problem}. vLLM serves it (it captures the last layer's output, as this evaluation does), "
                        "so these numbers hold for vLLM only")
    return config, warnings


def load_checked(target_dir, drafter_dir, config: DrafterConfig, device="cpu", target_dtype=torch.float32):
    """(Target, Drafter) for a drafter `check_for_eval` passed as `config`: the target tapped at the drafter's
    layers with its mask token, checked against the loaded target (its tokenizer's mask token, fingerprint),
    then the drafter's weights (checked finite)."""
    from dflash.io.drafter_dir import load_drafter
    from dflash.io.fit import check_fits_target
    from dflash.model.target import Target

    target = Target.load(target_dir, device=device, dtype=target_dtype, layer_ids=config.target_layer_ids,
                         mask_token=config.mask_token_id)
    check_fits_target(config, target, f"the drafter in {drafter_dir}")
    return target, load_drafter(drafter_dir, device=device).eval()


def load_for_eval(target_dir, drafter_dir, device="cpu", target_dtype=torch.float32):
    """(Target, Drafter) for evaluating the drafter in `drafter_dir` (the reference DFlash layout: one
    written by dflash-train, or a published one) on the target in `target_dir`.

    Everything is checked before a weight is read (`check_for_eval`, its warnings logged): the drafter's
    config.json, tensor names and dtypes, then its fit to the target's config.json (hidden size, layer
    count, tapped ids, vocabulary, mask token); the target is then tapped at the drafter's layers with its
    mask token. A drafter that names the target it was trained for (target_fingerprint) must name this
    one. On a CPU, bf16 weights are upcast to float32 (dflash.io.drafter_dir.load_drafter says so in the log).
    """
    config, warnings = check_for_eval(target_dir, drafter_dir)
    for warning in warnings:
        log.warning("%s", warning)
    return load_checked(target_dir, drafter_dir, config, device=device, target_dtype=target_dtype)


def untrained_drafter(target, config: DrafterConfig | None = None, seed: int = 0, **overrides) -> Drafter:
    """A freshly initialised drafter shaped like the trained one (without touching the global RNG)."""
    config = config or DrafterConfig.from_target(target, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = build_drafter(config)  # of the config's kind
    return drafter.to(device=target.device, dtype=target.dtype)


def evaluate_baseline(target, prompts: list[list[int]], max_new_tokens: int, kind: str = "repeat_last", *,
                      block_size: int | None = None, config: DrafterConfig | None = None, seed: int = 0,
                      **kwargs) -> dict:
    """evaluate() for a baseline: "repeat_last" (anchor repeated) or "untrained" (a fresh drafter,
    initialised from `seed`, which also seeds the sampling as in evaluate). Its block size is `config`'s
    (the drafter compared with), or `block_size` without a config."""
    if kind == "repeat_last":
        proposer = RepeatLastProposer(config.block_size if config else block_size)
    elif kind == "untrained":
        drafter = (untrained_drafter(target, config, seed, block_size=block_size) if config is None
                   else untrained_drafter(target, config, seed))
        proposer = DrafterProposer(drafter, incremental=kwargs.get("use_cache", True))
    else:
        raise ValueError(f"unknown baseline {kind!r}; choose 'repeat_last' or 'untrained'")
    return evaluate(target, proposer, prompts, max_new_tokens, seed=seed, **kwargs)


def _lossless_cell(report: dict) -> str:
    """"True", "True (N near-ties)", "False" or "-" (not checked)."""
    lossless, ties = report.get("lossless"), report.get("near_ties")
    if lossless is None:
        return "-"
    return f"True ({ties} near-tie{'s' * (ties != 1)})" if lossless and ties else str(lossless)


def format_results(results: dict[str, dict], max_divergences: int = 3) -> str:
    """A small table: one row per method: tau, spec tokens/s, plain decoding's tokens/s, speed-up,
    lossless ("True (N near-ties)" where outputs first differed from greedy at a near-tie); then the
    cache mode and temperature they ran with, and up to `max_divergences` lines per method saying where
    an output first differed from greedy and whether that was a near-tie or a failure."""
    rows = [f"{'method':<20} {'tau':>6} {'tokens/s':>10} {'plain tok/s':>12} {'speed-up':>9} {'lossless':>19}"]
    for name, r in results.items():
        plain, speedup = r.get("greedy_tokens_per_s"), r.get("speedup")
        rows.append(f"{name:<20} {r['tau']:>6.2f} {r['tokens_per_s']:>10.1f} "
                    f"{f'{plain:.1f}' if plain else '-':>12} {f'{speedup:.2f}x' if speedup else '-':>9} "
                    f"{_lossless_cell(r):>19}")
    first = next(iter(results.values()), {})
    if "cache" in first:
        rows.append(f"(target cache {first['cache']}, temperature {first.get('temperature', 0.0)}; plain = the "
                    "target alone, same cache; speed-up = tokens/s / plain tok/s)")
    for name, r in results.items():
        divergences = r.get("divergences") or []
        rows += [describe(name, d) for d in divergences[:max_divergences]]
        if len(divergences) > max_divergences:
            rows.append(f"{name}: {len(divergences) - max_divergences} more differing prompt(s) in --json")
    if any(r.get("near_ties") for r in results.values()):
        rows += [f"(near-tie: the greedy token's logit is at most {NEAR_TIE_ULPS} ulps of the top logit (in the "
                 "target's dtype) above the",
                 " speculative token's: the block pass and the one-token pass rounded a tie apart, not a decoding "
                 "error;", " see docs/evaluation-and-serving.md#exactness)"]
    return "\n".join(rows)
