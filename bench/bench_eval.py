"""Speculative decoding vs plain greedy decoding, with the target's caches and without, side by side.

    python bench/bench_eval.py --drafter DIR                  (make bench-eval DRAFTER=DIR; the demo target)
    python bench/bench_eval.py --target DIR --drafter DIR --data chat.jsonl --limit 16

For each mode (cache on, cache off) `dflash.decode.evaluate.evaluate` runs every prompt through speculative
decoding and then through plain greedy decoding by the target alone with the same caches, and reports
tau, both rates and speed-up = spec tokens/s / greedy tokens/s. With no --target the cached demo target
is used (built if missing) and its held-out demo conversations are the prompts (the ones after the
--demo-conversations the demo trains on, as dflash-train's demo evaluates them).
"""

from __future__ import annotations

import argparse
import sys

import torch

from dflash.decode.evaluate import evaluate, load_for_eval


def demo_prompts(tokenizer, n: int, trained_on: int, seed: int) -> list[list[int]]:
    from dflash.data.chat import prompt_ids
    from dflash.demo.corpus import demo_conversations

    held_out = demo_conversations(trained_on + n, seed=seed)[trained_on:]
    return [prompt_ids(tokenizer, c) for c in held_out]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", help="target dir (default: the cached demo target)")
    p.add_argument("--drafter", required=True, help="drafter dir (reference DFlash layout)")
    p.add_argument("--data", help="chat JSONL of prompts (default with the demo target: held-out demo prompts)")
    p.add_argument("--limit", type=int, default=8, help="prompts")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--demo-conversations", type=int, default=128, help="demo conversations the drafter "
                   "trained on (the held-out prompts come after them)")
    p.add_argument("--seed", type=int, default=0, help="the demo corpus seed")
    p.add_argument("--device", default="cpu", help="'cpu', 'cuda', 'cuda:N'")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a shared CPU)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    target_dir = args.target
    if target_dir is None:
        from dflash.demo.tiny_target import build_demo_target, default_demo_dir

        target_dir = build_demo_target(default_demo_dir(), seed=args.seed, progress=False)
    target, drafter = load_for_eval(target_dir, args.drafter, device=args.device)
    if args.data:
        from dflash.decode.run_eval import read_prompts

        prompts = read_prompts(target.tokenizer, args.data, None, args.limit)
    else:
        prompts = demo_prompts(target.tokenizer, args.limit, args.demo_conversations, args.seed)
    print(f"target {target_dir} ({target.config.model_type}, {target.num_layers} layers), drafter block "
          f"{drafter.config.block_size}, {len(prompts)} prompts x {args.max_new_tokens} new tokens, "
          f"{args.device}, {args.threads} thread(s)")
    rows = [f"{'target cache':<13} {'tau':>5} {'spec tok/s':>11} {'greedy tok/s':>13} {'speed-up':>9} {'lossless':>9}"]
    for use_cache in (True, False):
        r = evaluate(target, drafter, prompts, args.max_new_tokens, use_cache=use_cache)
        rows.append(f"{r['cache']:<13} {r['tau']:>5.2f} {r['tokens_per_s']:>11.1f} {r['greedy_tokens_per_s']:>13.1f} "
                    f"{r['speedup']:>8.2f}x {str(r['lossless']):>9}")
        print(rows[0] if len(rows) == 2 else "", rows[-1], sep="\n" if len(rows) == 2 else "", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
