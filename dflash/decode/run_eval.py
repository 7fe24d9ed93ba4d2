"""`dflash-eval`'s work: check the prompts and every drafter, load the target and the drafter, evaluate the
drafter beside the baselines, print the table (or JSON), return the exit code. dflash.cli only parses the flags.

Everything that can be checked from files alone is checked before a model loads: the flags, the --data or
--prompts file (read whole), and each drafter's config.json and tensor headers against the target's
config.json (dflash.decode.evaluate.check_for_eval, whose warnings go to stderr first).

`--compare DIR` evaluates more drafters of the same target on the same prompts (DFlash beside DFlash2).

Exit codes: 0; 1 when an evaluated drafter's output was not lossless (temperature 0 only: sampled outputs are
checked in distribution by the tests, not per run); a DflashError's own code otherwise. An output that first
differs from greedy decoding at a near-tie (dflash.decode.lossless) is lossless: it is counted, not failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash.errors import ConfigError, DataError
from dflash.kinds import kind_of

_WHAT = {"--data": "a chat JSONL file (one {\"messages\": [...]} conversation per line)",
         "--prompts": "a text file with one user prompt per line"}


def read_conversations(data: str | None, prompts_file: str | None, limit: int) -> list[list[dict]]:
    """At most `limit` conversations: those of a chat JSONL (`data`), or one user turn per line of a text
    file. Needs no model, so dflash-eval reads them before loading one."""
    from dflash.data.chat import load_chat_jsonl

    flag, path = ("--data", Path(data)) if data else ("--prompts", Path(prompts_file))
    if path.is_dir():
        files = sorted(p.name for p in path.iterdir() if p.is_file())[:3]
        example = f" (it holds {', '.join(files)})" if files else ""
        raise DataError(f"{flag} {path} is a directory{example}; dflash-eval reads {_WHAT[flag]}: pass one file")
    if not path.is_file():
        raise DataError(f"{flag} {path}: no such file; pass {_WHAT[flag]}")
    if data:
        conversations, _ = load_chat_jsonl(path)
    else:
        try:
            lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"{flag} {path} cannot be read ({exc}); pass {_WHAT[flag]} in UTF-8") from None
        conversations = [[{"role": "user", "content": ln}] for ln in lines]
    if not conversations:
        raise DataError(f"no prompt found in {flag} {path}; pass {_WHAT[flag]}")
    return conversations[:limit]


def read_prompts(tokenizer, data: str | None, prompts_file: str | None, limit: int) -> list[list[int]]:
    """Token ids of at most `limit` prompts: the user turns before each conversation's first answer in a
    chat JSONL (`data`), or one user prompt per line of a text file, wrapped in the chat template."""
    from dflash.data.chat import prompt_ids

    return [prompt_ids(tokenizer, c) for c in read_conversations(data, prompts_file, limit)]


def run_eval(args: argparse.Namespace) -> int:
    """Evaluate args.drafter (and each args.compare) on args.target (flags: dflash.cli.eval_parser); print;
    return the exit code."""
    from dflash import distributed
    from dflash.data.chat import prompt_ids
    from dflash.decode.evaluate import check_for_eval, evaluate, evaluate_baseline, format_results, load_checked

    if args.limit < 1 or args.max_new_tokens < 1:
        raise ConfigError(f"--limit ({args.limit}) and --max-new-tokens ({args.max_new_tokens}) must be at least 1.")
    if args.temperature < 0:
        raise ConfigError(f"--temperature {args.temperature} is negative; use 0 for greedy or a value > 0.")
    conversations = read_conversations(args.data, args.prompts, args.limit)
    configs = {}
    for directory in [args.drafter, *args.compare]:  # every drafter checked before any model loads
        configs[directory], warnings = check_for_eval(args.target, directory)
        for warning in warnings:
            print(f"dflash-eval: warning: {warning}", file=sys.stderr)
    target, drafter = load_checked(args.target, args.drafter, configs[args.drafter],
                                   device=distributed.pick_device(args.device, 0))
    prompts = [prompt_ids(target.tokenizer, c) for c in conversations]
    options = dict(use_cache=args.cache, temperature=args.temperature, seed=args.seed)
    results = {"drafter": evaluate(target, drafter, prompts, args.max_new_tokens, **options)}
    for other in args.compare:  # a target tapped at its own layers (they may differ from --drafter's)
        _, compared = load_checked(args.target, other, configs[other], device=target.device)
        results[_row_name(results, kind_of(compared).name, other)] = evaluate(target, compared, prompts,
                                                                     args.max_new_tokens, **options)
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


def _row_name(results: dict, kind: str, directory: str) -> str:
    """The row of a --compare drafter: its kind and directory name ("dflash2 drafter"); the path as given when
    another row has that name (two runs' `drafter/` of one kind), then `#k` (one directory given twice)."""
    for name in (f"{kind} {Path(directory).name}", f"{kind} {directory}"):
        if name not in results:
            return name
    k = 2
    while f"{kind} {directory} #{k}" in results:
        k += 1
    return f"{kind} {directory} #{k}"
