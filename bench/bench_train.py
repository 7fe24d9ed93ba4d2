"""Drafter training benchmark: tokens/s of the real training loop, and where a step's time goes.

    python bench/bench_train.py                       demo target, then a larger random Qwen3.5 hybrid
    python bench/bench_train.py --presets 27b --variants before,after --json out.json   (one H200)
    python bench/bench_train.py --presets large --hidden 4096 --layers 32 --vocab 248320
    python bench/bench_train.py --lengths chat|FILE   a mix of lengths, padded against packed (bench_length_mix.py)

Presets: demo (the built-in demo target), large (a random Qwen3.5 hybrid sized by --hidden/--layers/
--vocab), 27b (a random target of Qwen3.5-27B's exact shape: 64 layers, hidden 5120, 26.9B parameters,
54 GB in bf16). For each target and each --attention implementation of the drafter:
  1. throughput: `dflash.train.trainer.train` itself runs --steps optimizer steps on synthetic sequences (the
     first --warmup steps are not counted); tokens/s counts the real (unpadded) sequence tokens;
  2. time split: the trainer's own micro-batch step (dflash.train.step: micro_batch_sums, backward) timed
     phase by phase (CUDA synchronised before every clock read): target forward (blocks, context,
     block embeddings), drafter forward (+ head + loss), drafter backward (+ clip), optimizer step;
  3. model FLOPs utilisation (GPU): the step's model FLOPs (below) per second of the training loop,
     over a bf16 matmul peak measured in the same run (8192^3 products on random data).
Model FLOPs of one step (dflash/train/probes/mfu.py, shared with the trainer's MFU; the useful work: recomputation
and masked-out attention do not count):
  target forward  2 x (decoder-layer parameters) x tokens + 4 x head_dim x heads x (causal query-key
                  pairs) per full-attention layer (the GatedDeltaNet recurrences, under 1 %, are left out)
  drafter         3 x forward: 2 x parameters x the rows each matrix sees (q/o/MLP: block rows; k/v:
                  context + block rows; fc: context rows) + 4 x head_dim x heads x (visible query-key
                  pairs of the drafter mask)
  LM head         4 x hidden x vocab x scored rows (forward + input gradient; the head is frozen)
The drafter's micro-batch alone (forward + loss, backward; variants, memory, gradients against fp32) is
bench/bench_drafter.py's: `python bench/bench_drafter.py` runs it at the 27B shape in one command.
The targets have random weights (speed does not depend on them). On a GPU the target runs in bf16
with the drafter under bf16 autocast, as in training; on a CPU both run in fp32.
Variants (--variants): after = the trainer as it is (compiled drafter layers on a GPU, the LM head fused
with the loss); before = --compile off and the target's head offered only as a callable
(`HeadAsCallable`), so the step takes the checkpointed head chunks: the step before those two changes.
The phase split reports each phase's model TFLOP/s and share of the measured peak: target forward (its
FLOPs), drafter forward (the drafter's forward + the head's logits product), drafter backward (the
drafter's 2x forward + the head's input-gradient product).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflash import distributed
from dflash.config import TrainConfig
from dflash.model.drafter import Drafter, DrafterConfig
from dflash.model.target import Target
from dflash.train.probes.mfu import batch_flops
from dflash.model.shapes import QWEN35_27B, random_target, scaled_qwen35_shape
from dflash.train.step import backward, micro_batch_sums
from dflash.train.probes.synthetic import collate_with_anchors, synthetic_items
from dflash.train.probes.timing import free_memory, matmul_peak, sync
from dflash.train.setup import attention_impl, auto_precision, compile_layers, precision
from dflash.train.trainer import train

VARIANTS = ("before", "after")


class HeadAsCallable:
    """The target with its LM head offered only as a callable (head_weight None), so dflash.train.step takes
    the checkpointed chunks: the head of the 'before' variant. Everything else is the target's."""

    head_weight = None

    def __init__(self, target):
        self._target = target

    def __getattr__(self, name):
        return getattr(self._target, name)


def demo_target(device: torch.device, dtype: torch.dtype) -> Target:
    from dflash.demo.tiny_target import build_demo_target

    return Target.load(build_demo_target(progress=True), device=device, dtype=dtype)


def large_target(args, device: torch.device, dtype: torch.dtype, shape: dict | None = None) -> Target:
    """A random Qwen3.5 hybrid (3 GatedDeltaNet : 1 full attention) of `shape`, or sized by --hidden/--layers/
    --vocab (dflash.model.shapes.scaled_qwen35_shape), built on `device`."""
    return random_target(shape or scaled_qwen35_shape(args.hidden, args.layers, args.vocab), device, dtype)


def throughput(target, items, cfg: TrainConfig, warmup: int) -> dict:
    """Run the real training loop; tokens/s over the steps after `warmup`."""
    stamps = []

    def on_step(step, metrics):
        sync(target.device)
        stamps.append((time.perf_counter(), metrics["tokens"]))
        if len(stamps) > 1:  # each step as it ends: a run cut short still says how fast its steps were
            print(json.dumps({"step": step, "seconds": round(stamps[-1][0] - stamps[-2][0], 4),
                              "tokens": metrics["tokens"]}), flush=True)

    result = train(cfg, target=target, items=items, on_step=on_step, handle_signals=False)
    timed = stamps[warmup:]
    seconds = timed[-1][0] - stamps[warmup - 1][0] if warmup else timed[-1][0] - timed[0][0]
    tokens = sum(t for _, t in (timed if warmup else timed[1:]))
    return {"tokens_per_s": tokens / seconds, "steps_timed": len(timed) if warmup else len(timed) - 1,
            "final_loss": result.history[-1]["loss"], "losses": [m["loss"] for m in result.history]}


def first_micro_batch(target, items, cfg: TrainConfig):
    """(batch on the device, anchors, drafter config) of the loop's first micro-batch, as the trainer makes them."""
    batch, anchors = collate_with_anchors(items[: cfg.optim.batch_size], cfg.model.max_anchors, target.device)
    dcfg = DrafterConfig.from_target(target, num_hidden_layers=cfg.model.drafter_layers,
                                     block_size=cfg.model.block_size)
    return batch, anchors, dcfg


def time_split(target, items, cfg: TrainConfig, reps: int, peak: float | None = None) -> dict:
    """Median seconds per phase of one micro-batch step: dflash.train.step's functions, as the trainer calls
    them, with the clock read (after a CUDA sync) between the phases."""
    device = target.device
    d = distributed.Dist(rank=0, world_size=1, local_rank=0, device=device)  # this process alone
    batch, anchors, dcfg = first_micro_batch(target, items, cfg)
    torch.manual_seed(0)
    drafter = Drafter(dcfg, attention=attention_impl(cfg, device, dcfg.head_dim)).to(device)
    if compile_layers(cfg, device):
        drafter.compile_layers()
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.optim.lr, fused=device.type == "cuda")
    phases: dict[str, list[float]] = {"target forward": [], "drafter forward": [], "drafter backward": [],
                                      "optimizer step": []}
    for rep in range(reps + 1):
        stamps = {}

        def mark(phase: str) -> None:
            sync(device)
            stamps[phase] = time.perf_counter()

        mark("start")
        sums = micro_batch_sums(drafter, target, batch, anchors, block_size=cfg.model.block_size,
                                gamma=cfg.model.gamma, autocast_dtype=precision(cfg, device), mark=mark)
        backward(sums, d, grad_accum=1)
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.optim.grad_clip)
        mark("drafter backward")
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark("optimizer step")
        if rep:  # the first repetition warms up kernels and allocators
            previous = stamps["start"]
            for name in phases:
                phases[name].append(stamps[name] - previous)
                previous = stamps[name]
    med = {name: statistics.median(v) for name, v in phases.items()}
    total = sum(med.values())
    tokens = int(batch["attention_mask"].sum())
    flops = batch_flops(target, batch, anchors, dcfg)
    phase_flops = {"target forward": flops["target_forward"], "drafter forward": flops["drafter"] / 3 + flops["lm_head"] / 2,
                   "drafter backward": 2 * flops["drafter"] / 3 + flops["lm_head"] / 2, "optimizer step": 0.0}
    tflops = {name: phase_flops[name] / med[name] / 1e12 for name in phases}
    drafter_params = sum(p.numel() for p in drafter.parameters())
    del drafter, opt, sums
    free_memory(device)
    return {"step_s": total, "tokens_per_s": tokens / total, "model_flops": flops,
            "share": {name: round(v / total, 3) for name, v in med.items()},
            "tflops": {name: round(v, 1) for name, v in tflops.items()},
            "share_of_peak": {name: round(v / peak, 3) for name, v in tflops.items()} if peak else None,
            "seconds": {name: round(v, 5) for name, v in med.items()},
            "drafter_params": drafter_params, "anchors": sum(int(a.numel()) for a in anchors)}


def bench_one(name: str, target, args, device, attention: str, variant: str, peak: float | None) -> dict:
    seq = min(args.seq_len, 256) if name == "demo" else args.seq_len
    # the loop ends by writing a checkpoint (22 GB at the 27B shape) that is not what is measured: RAM-backed
    # scratch space where there is one keeps that write from costing a minute of the benchmark
    scratch = "/dev/shm" if os.access("/dev/shm", os.W_OK) and shutil.disk_usage("/dev/shm").free > 40e9 else None
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-", dir=scratch) as out:
        row = _bench_in(name, HeadAsCallable(target) if variant == "before" else target, args, device, seq, out,
                        attention, variant, peak)
    free_memory(device)
    if peak and ("split" in row or "model_flops" in row):
        flops = row["split"]["model_flops"] if "split" in row else row["model_flops"]
        step_s = flops["tokens"] / row["loop"]["tokens_per_s"]  # seconds per micro-batch in the real loop
        row["peak_tflops"] = peak
        row["model_tflops_per_s"] = flops["total"] / step_s / 1e12
        row["mfu"] = row["model_tflops_per_s"] / peak
    return row


def _bench_in(name: str, target, args, device, seq: int, out: str, attention: str, variant: str,
              peak: float | None) -> dict:
    cfg = TrainConfig.from_flat(
        out=out, block_size=args.block_size, drafter_layers=args.drafter_layers,
        max_length=max(seq, 2 * args.block_size), max_tokens=max(seq, 2 * args.block_size) * args.batch_size,
        batch_size=args.batch_size, max_anchors=args.anchors, max_steps=args.steps + args.warmup, epochs=0,
        save_every=0, log_every=10**6, progress=False, device=str(device), attention=attention,
        compile="off" if variant == "before" else "auto",
    )
    items = synthetic_items(args.batch_size * (args.steps + args.warmup), seq, target.vocab_size)
    row = {"target": name, "device": str(device), "target_params": sum(p.numel() for p in target.model.parameters()),
           "hidden": target.hidden_size, "layers": target.num_layers, "vocab": target.vocab_size,
           "variant": variant, "seq_len": seq, "batch_size": args.batch_size, "anchors": args.anchors, "block_size": args.block_size,
           "attention": attention_impl(cfg, device, getattr(target.config, "head_dim", None)), "kernels": target.kernel_report()}
    row["loop"] = throughput(target, items, cfg, args.warmup)
    if args.no_split:
        row["model_flops"] = batch_flops(target, *first_micro_batch(target, items, cfg))
    else:
        row["split"] = time_split(target, items, cfg, args.reps, peak)
    return row


def report(rows: list[dict]) -> str:
    lines = [f"{'target':<6} {'attn':<5} {'variant':<7} {'params':>8} {'seq x B':>9} {'anchors':>7} {'loop tok/s':>11} "
             f"{'MFU':>6}  per phase: share of the step, TFLOP/s (share of peak)"]
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if "mfu" in r else "-"
        head = (f"{r['target']:<6} {r['attention']:<5} {r['variant']:<7} {r['target_params'] / 1e6:>7.0f}M "
                f"{r['seq_len']:>5} x {r['batch_size']:<2} {r['split']['anchors'] if 'split' in r else '-':>7} "
                f"{r['loop']['tokens_per_s']:>11.0f} {mfu:>6}  ")
        if "split" not in r:
            lines.append(head + "(no split)")
            continue
        sp = r["split"]
        parts = []
        for name in ("target forward", "drafter forward", "drafter backward", "optimizer step"):
            of_peak = f" ({sp['share_of_peak'][name]:.0%})" if sp.get("share_of_peak") and name != "optimizer step" else ""
            tf = f" {sp['tflops'][name]:.0f}{of_peak}" if name != "optimizer step" else ""
            parts.append(f"{name} {sp['share'][name]:.1%}{tf}")
        lines.append(head + "; ".join(parts))
    if rows and "peak_tflops" in rows[0]:
        lines.append(f"bf16 matmul peak measured in this run: {rows[0]['peak_tflops']:.0f} TFLOP/s")
    by_key: dict[tuple, dict] = {}
    for r in rows:
        by_key.setdefault((r["target"], r["attention"]), {})[r["variant"]] = r
    for (name, attention), runs in by_key.items():
        if {"before", "after"} <= runs.keys():
            a, b = runs["before"], runs["after"]
            line = f"{name} {attention}: after/before loop tokens/s {b['loop']['tokens_per_s'] / a['loop']['tokens_per_s']:.2f}x"
            if "split" in a and "split" in b:
                da = a["split"]["seconds"]["drafter forward"] + a["split"]["seconds"]["drafter backward"]
                db = b["split"]["seconds"]["drafter forward"] + b["split"]["seconds"]["drafter backward"]
                line += f", drafter fwd+bwd {da * 1e3:.0f} -> {db * 1e3:.0f} ms ({da / db:.2f}x)"
            lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--presets", default="demo,large", help="comma list of: demo, large, 27b")
    p.add_argument("--attention", default="auto", help="comma list of drafter attentions to compare: auto, sdpa, flex")
    p.add_argument("--variants", default="after", help="comma list of: before (eager layers, checkpointed head), after")
    p.add_argument("--device", default="auto", help="'auto' (cuda if there), 'cpu', 'cuda'")
    p.add_argument("--steps", type=int, default=None, help="timed optimizer steps (default: 20 on GPU, 3 on CPU)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    p.add_argument("--reps", type=int, default=5, help="repetitions of the phase-by-phase step")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--anchors", type=int, default=None, help="max anchors per sequence (default: 512 GPU, 32 CPU)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: 2 GPU, 2 CPU)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence of the large target (default: 4096 GPU, 256 CPU)")
    p.add_argument("--hidden", type=int, default=None, help="large target width (default: 2048 GPU, 256 CPU)")
    p.add_argument("--layers", type=int, default=None, help="large target layers (default: 16 GPU, 4 CPU)")
    p.add_argument("--vocab", type=int, default=None, help="large target vocabulary (default: 151936 GPU, 8192 CPU)")
    p.add_argument("--no-split", action="store_true", help="only the training loop (no phase-by-phase split)")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--lengths", help="'chat' or a FILE: train on a mix of lengths, padded against packed, instead "
                   "(bench/bench_length_mix.py, which takes the rest of the flags)")
    args, rest = p.parse_known_args(argv)
    if args.lengths:  # every flag but --lengths goes to the length-mix benchmark as given
        from bench_length_mix import main as length_mix
        from bench_length_mix import without

        given = without(list(sys.argv[1:] if argv is None else argv), ("--lengths",))
        return length_mix(([] if args.lengths == "chat" else ["--data", args.lengths]) + given)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    gpu = (args.device == "auto" and torch.cuda.is_available()) or args.device.startswith("cuda")
    # Under torchrun every rank builds its own target on its own GPU; only rank 0 reports.
    local_rank, main_rank = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("RANK", "0")) == 0
    device = torch.device("cuda", local_rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    for key, on_gpu, on_cpu in (("steps", 20, 3), ("anchors", 512, 32), ("batch_size", 2, 2), ("seq_len", 4096, 256),
                                ("hidden", 2048, 256), ("layers", 16, 4), ("vocab", 151936, 8192)):
        if getattr(args, key) is None:
            setattr(args, key, on_gpu if gpu else on_cpu)
    dtype = auto_precision(device)
    presets = [s.strip() for s in args.presets.split(",") if s.strip()]
    attentions = [a.strip() for a in args.attention.split(",") if a.strip()]
    for name in presets:
        if name not in ("demo", "large", "27b"):
            p.error(f"unknown preset '{name}'; choose from demo, large, 27b")
    for a in attentions:
        if a not in ("auto", "sdpa", "flex"):
            p.error(f"unknown attention '{a}'; choose from auto, sdpa, flex")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            p.error(f"unknown variant '{v}'; choose from {', '.join(VARIANTS)}")
    peak = matmul_peak(device) if gpu else None
    if peak and main_rank:
        print(f"bf16 matmul peak: {peak:.0f} TFLOP/s", flush=True)
    rows = []
    for name in presets:
        target = (demo_target(device, dtype) if name == "demo" else
                  large_target(args, device, dtype, QWEN35_27B if name == "27b" else None))
        for attention, variant in ((a, v) for a in attentions for v in variants):
            try:
                rows.append(bench_one(name, target, args, device, attention, variant, peak))
            except Exception as e:  # one failing variant must not lose the others' figures
                print(json.dumps({"target": name, "attention": attention, "variant": variant,
                                  "error": f"{type(e).__name__}: {e}"}), flush=True)
                free_memory(device)
                continue
            if main_rank:
                print(json.dumps(rows[-1], default=str), flush=True)
        del target
        free_memory(device)
    if not main_rank:
        return 0
    print("\n" + report(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
