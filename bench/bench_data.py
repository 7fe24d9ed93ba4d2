"""Data benchmark: conversations tokenised per second with 1 and N processes, and the time to the first
training step on a cold and on a warm token cache.

    python bench/bench_data.py                                   (make bench-data: 100k conversations)
    python bench/bench_data.py --conversations 2000 --procs 1,2  (a quick look)

The synthetic set: multi-turn chats (2-4 user turns), a third of the answers with reasoning, every
fifth conversation with a tool call and its result, written as chat JSONL. The tokenizer is a byte-level
BPE trained on a sample of the set (dflash.demo.tokenizer), with chat_templates/think_in_prompt.jinja
(Qwen3.5's rules: think block in the generation prompt, reasoning stripped from history), the span
locator's slowest path. Tokenisation runs through dflash.data.token_cache exactly as a run does. The time to
first step trains a tiny random Qwen3 target (6 layers, hidden 32, its vocabulary sized to the tokenizer)
for one step with `dflash.train`, first with an empty cache (tokenises everything), then again with the
cache it left (the second start).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Qwen3.5's chat rules, the span locator's slowest path (the span tests render the same file)
TEMPLATE = Path(__file__).resolve().parents[1] / "chat_templates" / "think_in_prompt.jinja"

WORDS = ("the a fox river count number list answer because first then after sum prime city weather "
         "table function value result step check small large north south read write").split()


def synthetic(n: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)

    def text(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    convs = []
    for i in range(n):
        msgs = [{"role": "system", "content": "You are helpful."}] if i % 4 == 0 else []
        for turn in range(rng.randint(2, 4)):
            msgs.append({"role": "user", "content": text(5, 30)})
            if i % 5 == 0 and turn == 0:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "lookup", "arguments": {"query": text(2, 5)}}}]})
                msgs.append({"role": "tool", "content": text(5, 20)})
            answer = {"role": "assistant", "content": text(20, 120)}
            if rng.random() < 1 / 3:
                answer["reasoning_content"] = text(10, 60)
            msgs.append(answer)
        convs.append(msgs)
    return convs


def make_tokenizer(convs):
    from dflash.demo.tokenizer import build_chat_tokenizer

    sample = [" ".join(m["content"] for m in c) for c in convs[:2000]]
    tok = build_chat_tokenizer(sample, vocab_size=1024)
    tok.chat_template = TEMPLATE.read_text()
    return tok


def tokenise_rate(data: Path, tok, procs: int, work: Path) -> dict:
    from dflash.data.token_cache import tokenize_source

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    kept, report = tokenize_source(data, tok, max_length=4096, min_supervised=32, work_dir=work, num_proc=procs,
                                   progress=False)
    seconds = time.perf_counter() - t0
    shutil.rmtree(work, ignore_errors=True)
    return {"procs": procs, "seconds": round(seconds, 2), "conversations_per_s": round(report.n_read / seconds, 1),
            "kept": report.n_kept, "skipped": dict(report.skipped)}


def save_target(out: Path, tok) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def time_to_first_step(target: Path, data: Path, out: Path, cache: Path, procs: int) -> float:
    from dflash.config import TrainConfig
    from dflash.train.trainer import train

    config = TrainConfig.from_flat(target=str(target), data=str(data), out=str(out), data_cache=str(cache),
                                   num_proc=procs, block_size=4, drafter_layers=1, max_length=512, max_tokens=2048,
                                   batch_size=4, max_anchors=8, max_steps=1, epochs=0, save_every=0, device="cpu",
                                   progress=False, attention="sdpa", cpu_threads=1, overwrite=True)
    first: list[float] = []
    t0 = time.perf_counter()
    train(config, handle_signals=False, on_step=lambda step, m: first.append(time.perf_counter() - t0) or True)
    return first[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cores = len(os.sched_getaffinity(0))
    p.add_argument("--conversations", type=int, default=100_000, help="size of the synthetic set")
    p.add_argument("--procs", default=f"1,{cores}", help="comma-separated --num-proc values to measure")
    p.add_argument("--work", default=None, help="scratch dir (default: a temporary one, removed at the end)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        convs = synthetic(args.conversations)
        data = work / "chat.jsonl"
        data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
        tok = make_tokenizer(convs)
        procs = [int(x) for x in args.procs.split(",")]
        results = {"conversations": args.conversations, "cores": cores, "data_mb": round(data.stat().st_size / 1e6, 1),
                   "tokenise": [tokenise_rate(data, tok, n, work / f"tok-{n}") for n in procs]}
        for r in results["tokenise"]:
            print(f"tokenise {args.conversations} conversations, {r['procs']:>2} proc: {r['seconds']:8.1f} s "
                  f"{r['conversations_per_s']:9.1f} conversations/s  (kept {r['kept']}, skipped {r['skipped']})")
        target = save_target(work / "target", tok)
        cold = time_to_first_step(target, data, work / "run-1", work / "cache", max(procs))
        warm = time_to_first_step(target, data, work / "run-2", work / "cache", max(procs))
        results["first_step_s"] = {"cold_cache": round(cold, 2), "second_start": round(warm, 2)}
        print(f"time to first step: cold cache {cold:.1f} s ({max(procs)} proc), second start {warm:.1f} s")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
