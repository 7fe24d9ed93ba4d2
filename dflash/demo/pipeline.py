"""The demo run: build (or reuse) the demo target, regenerate its training data with the target itself,
train a drafter, then print tau beside the untrained-drafter and repeat-last-token baselines."""

from __future__ import annotations

import json
import logging

from common.fsutil import atomic_write

from dflash import distributed
from dflash.data.chat import load_chat_jsonl, prompt_ids, write_jsonl
from dflash.config import TrainConfig
from dflash.data.batches import ChatDataset, dataset_items
from dflash.decode.evaluate import evaluate, evaluate_baseline, format_results
from dflash.regenerate.local import regenerate
from dflash.train.trainer import load_target, setup_logging, train
from dflash.demo.corpus import demo_conversations
from dflash.demo.target import build_demo_target

log = logging.getLogger(__name__)


def demo_data(config: TrainConfig, target, conversations: list[list[dict]], d: distributed.Dist) -> list[list[dict]]:
    """The demo's training conversations with the target's own answers, cached in <out>/demo-data.jsonl."""
    path = config.out_dir / "demo-data.jsonl"
    if path.exists():
        cached, _ = load_chat_jsonl(path, on_error="skip")
        if len(cached) == len(conversations):
            return cached
    if d.is_main:
        log.info("regenerating %d demo answers with the target (greedy)", len(conversations))
        write_jsonl(path, regenerate(target, conversations, config.regen_new_tokens, temperature=0.0))
    distributed.barrier(d)
    return load_chat_jsonl(path, on_error="stop")[0]


def run_demo(config: TrainConfig) -> int:
    """Build (or reuse) the tiny demo target, regenerate its data, train, then print tau beside the
    untrained-drafter and repeat-last-token baselines; <out>/eval.json keeps the numbers. Returns the
    exit code (1 when the trained drafter's output was not lossless)."""
    d = distributed.init(config.device, cpu_threads=config.cpu_threads)
    setup_logging(config.out_dir, d.is_main)
    if d.is_main:
        build_demo_target(config.demo_target_dir(), seed=config.seed, progress=config.progress)
    distributed.barrier(d)  # other ranks load the target rank 0 built (cached: no second build)
    path = build_demo_target(config.demo_target_dir(), seed=config.seed, progress=False)
    target = load_target(config, d.device, path)
    conversations = demo_conversations(config.demo_conversations + config.eval_prompts, seed=config.seed)
    held_out = conversations[config.demo_conversations:]
    regenerated = demo_data(config, target, conversations[: config.demo_conversations], d)
    dataset = ChatDataset(regenerated, target.tokenizer, max_length=config.max_length,
                          block_size=config.block_size)
    result = train(config, target=target, items=dataset_items(dataset))
    if result.stopped_by or not d.is_main:
        return result.exit_code
    prompts = [prompt_ids(target.tokenizer, c) for c in held_out]
    drafter = result.drafter.eval()
    n, show = config.eval_new_tokens, config.progress
    results = {
        "trained drafter": evaluate(target, drafter, prompts, n, progress=show),
        "untrained drafter": evaluate_baseline(target, prompts, n, kind="untrained", config=drafter.config,
                                               seed=config.seed, progress=show),
        "repeat last token": evaluate_baseline(target, prompts, n, kind="repeat_last", config=drafter.config,
                                               progress=show),
    }
    atomic_write(config.out_dir / "eval.json", json.dumps(results, indent=2, default=str) + "\n")
    print(f"\nDFlash demo: {len(prompts)} held-out prompts, {config.eval_new_tokens} new tokens each, "
          f"block size {config.block_size}, {result.step} training steps\n" + format_results(results))
    print(f"drafter: {config.out_dir / 'drafter'}")
    return 0 if results["trained drafter"].get("lossless", True) else 1
