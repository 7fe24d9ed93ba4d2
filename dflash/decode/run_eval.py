"""`dflash-eval`'s work: load the target and the drafter, read the prompts, evaluate the drafter beside
the baselines, print the table (or JSON), return the exit code. dflash.cli only parses the flags.

`--compare DIR` evaluates more drafters of the same target on the same prompts (DFlash beside DFlash2).

Exit codes: 0; 1 when an evaluated drafter's output was not lossless (temperature 0 only: sampled outputs are
checked in distribution by the tests, not per run); a DflashError's own code otherwise.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash.errors import ConfigError


def read_prompts(tokenizer, data: str | None, prompts_file: str | None, limit: int) -> list[list[int]]:
    """Token ids of at most `limit` prompts: the user turns before each conversation's first answer in a
    chat JSONL (`data`), or one user prompt per line of a text file, wrapped in the chat template."""
    from dflash.data.chat import load_chat_jsonl, prompt_ids

    if data:
        conversations, _ = load_chat_jsonl(data)
    else:
        lines = [ln.strip() for ln in Path(prompts_file).read_text().splitlines() if ln.strip()]
        conversations = [[{"role": "user", "content": ln}] for ln in lines]
    prompts = [prompt_ids(tokenizer, c) for c in conversations[:limit]]
    if not prompts:
        raise ConfigError(f"no prompt found in {data or prompts_file}; it needs at least one user turn.")
    return prompts


def run_eval(args: argparse.Namespace) -> int:
    """Evaluate args.drafter (and each args.compare) on args.target (flags: dflash.cli.eval_parser); print; return the exit code."""
    from dflash import distributed
    from dflash.decode.evaluate import evaluate, evaluate_baseline, format_results, load_for_eval

    if args.limit < 1 or args.max_new_tokens < 1:
        raise ConfigError(f"--limit ({args.limit}) and --max-new-tokens ({args.max_new_tokens}) must be at least 1.")
    if args.temperature < 0:
        raise ConfigError(f"--temperature {args.temperature} is negative; use 0 for greedy or a value > 0.")
    target, drafter = load_for_eval(args.target, args.drafter, device=distributed.pick_device(args.device, 0))
    prompts = read_prompts(target.tokenizer, args.data, args.prompts, args.limit)
    options = dict(use_cache=args.cache, temperature=args.temperature, seed=args.seed)
    results = {"drafter": evaluate(target, drafter, prompts, args.max_new_tokens, **options)}
    for other in args.compare:  # checked against the same target before any decoding (load_for_eval)
        _, compared = load_for_eval(args.target, other, device=target.device)
        results[f"{compared.kind} {Path(other).name}"] = evaluate(target, compared, prompts, args.max_new_tokens,
                                                                  **options)
    if args.baselines:
        for name, kind in (("untrained drafter", "untrained"), ("repeat last token", "repeat_last")):
            results[name] = evaluate_baseline(target, prompts, args.max_new_tokens, kind=kind,
                                              config=drafter.config, **options)
    print(json.dumps(results, indent=2, default=str) if args.json else format_results(results))
    if not args.json and args.compare:
        for name in list(results)[:1 + len(args.compare)]:  # --drafter, then each --compare
            print(f"acceptance per draft position, {name}: "
                  + " ".join(f"{a:.2f}" for a in results[name]["accept_per_pos"]))
    return 1 if any(r.get("lossless") is False for r in results.values()) else 0
