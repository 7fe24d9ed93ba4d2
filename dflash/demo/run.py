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
from dflash.kinds import named
from dflash.regenerate.local import regenerate
from dflash.train.parallel import drafter_state
from dflash.train.records.monitor import claimed_run
from dflash.train.records.rundir import RunDir
from dflash.train.setup import load_target
from dflash.train.trainer import train
from dflash.demo import cpu_numerics
from dflash.demo.corpus import demo_conversations
from dflash.demo.tiny_target import build_demo_target

log = logging.getLogger(__name__)


def demo_data(config: TrainConfig, target, conversations: list[list[dict]], d: distributed.Dist) -> list[list[dict]]:
    """The demo's training conversations with the target's own answers, cached in <out>/demo-data.jsonl."""
    path = RunDir(config.io.out).demo_data
    if path.exists():
        cached, _ = load_chat_jsonl(path, on_error="skip")
        if len(cached) == len(conversations):
            return cached
    if d.is_main:
        log.info("regenerating %d demo answers with the target (greedy)", len(conversations))
        write_jsonl(path, regenerate(target, conversations, config.demo.regen_new_tokens, temperature=0.0))
    distributed.barrier(d)
    return load_chat_jsonl(path, on_error="stop")[0]


def run_demo(config: TrainConfig) -> int:
    """Build (or reuse) the tiny demo target, regenerate its data, train, then print tau beside the
    untrained-drafter and repeat-last-token baselines; <out>/eval.json keeps the numbers. Returns the
    exit code (1 when the trained drafter's output was not lossless). With --cpu-kernels portable (the
    default) the CPU kernels are held to one path first (dflash.demo.cpu_numerics), so every x86-64 CPU
    prints the same tau. The run holds --out from the first write of its data to its evaluation
    (dflash.train.records.rundir)."""
    if config.demo.cpu_kernels == "portable":
        cpu_numerics.hold()  # before any tensor op: ATen and MKL read their settings at their first kernel
    # the layout's process group, held past train(): a sharded drafter is gathered after it for the evaluation
    with drafter_state.of(config.layout).joined(config) as d, claimed_run(config, d) as run:
        return _run_demo(config, run, d)


def _run_demo(config: TrainConfig, run: RunDir, d: distributed.Dist) -> int:
    demo, seed, show = config.demo, config.optim.seed, config.runtime.progress
    if d.is_main:
        build_demo_target(demo.target_dir(), seed=seed, pretrain_steps=demo.pretrain_steps, progress=show)
    distributed.barrier(d)  # other ranks load the target rank 0 built (cached: no second build)
    path = build_demo_target(demo.target_dir(), seed=seed, pretrain_steps=demo.pretrain_steps, progress=False)
    target = load_target(config, d.device, path)
    conversations = demo_conversations(demo.demo_conversations + demo.eval_prompts, seed=seed)
    held_out = conversations[demo.demo_conversations:]
    regenerated = demo_data(config, target, conversations[: demo.demo_conversations], d)
    dataset = ChatDataset(regenerated, target.tokenizer, max_length=config.model.max_length,
                          block_size=config.model.block_size)
    result = train(config, target=target, items=dataset_items(dataset))
    if result.stopped_by or result.drafter is None:  # stopped, or a --layout pipeline target stage
        return result.exit_code
    # whole on rank 0: a sharded drafter's shards gathered (a collective of the drafter's ranks)
    drafter = drafter_state.of(config.layout).whole(result.drafter, d)
    if not d.is_main:
        return result.exit_code
    prompts = [prompt_ids(target.tokenizer, c) for c in held_out]
    drafter = drafter.eval()
    n = demo.eval_new_tokens
    results = {
        "trained drafter": evaluate(target, drafter, prompts, n, progress=show),
        "untrained drafter": evaluate_baseline(target, prompts, n, kind="untrained", config=drafter.config,
                                               seed=seed, progress=show),
        "repeat last token": evaluate_baseline(target, prompts, n, kind="repeat_last", config=drafter.config,
                                               progress=show),
    }
    atomic_write(run.eval_results, json.dumps(results, indent=2, default=str) + "\n")
    print(f"\n{named(config.model.drafter_kind).title} demo: {len(prompts)} held-out prompts, {n} new tokens each, "
          f"block size {config.model.block_size}, {result.step} training steps\n" + format_results(results))
    print("acceptance per draft position (trained drafter): "
          + " ".join(f"{a:.2f}" for a in results["trained drafter"]["accept_per_pos"]))
    print(f"drafter: {run.drafter}")
    return 0 if results["trained drafter"].get("lossless", True) else 1
