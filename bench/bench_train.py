"""Drafter training benchmark: tokens/s of the real training loop, and where a step's time goes.

    python bench/bench_train.py                       demo target, then a larger random Qwen3.5 hybrid
    python -m bench.bench_train --presets large --hidden 4096 --layers 32 --vocab 248320 --json out.json

For each target:
  1. throughput: `dflash.train.train` itself runs --steps optimizer steps on synthetic sequences (the
     first --warmup steps are not counted); tokens/s counts the real (unpadded) sequence tokens;
  2. time split: the same step taken apart and timed phase by phase (CUDA synchronised before every
     clock read): target forward (context + block embeddings), drafter forward (+ head + loss),
     drafter backward, optimizer step.
The large target has random weights (speed does not depend on them). On a GPU the target runs in bf16
with the drafter under bf16 autocast, as in training; on a CPU both run in fp32.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dflash.config import TrainConfig  # noqa: E402
from dflash.losses import dflash_loss_from_hidden  # noqa: E402
from dflash.model import Drafter, DrafterConfig  # noqa: E402
from dflash.target import Target  # noqa: E402
from dflash.train import anchor_seed, build_blocks, sample_anchors, train  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def demo_target(device: torch.device, dtype: torch.dtype) -> Target:
    from dflash.demo import build_demo_target

    return Target.load(build_demo_target(progress=True), device=device, dtype=dtype)


def large_target(args, device: torch.device, dtype: torch.dtype) -> Target:
    """A random Qwen3.5 hybrid (3 GatedDeltaNet : 1 full attention) of the given size, built on `device`."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    H, L = args.hidden, args.layers
    config = Qwen3_5TextConfig(
        vocab_size=args.vocab, hidden_size=H, intermediate_size=3 * H, num_hidden_layers=L,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(L)],
        num_attention_heads=max(1, H // 128), num_key_value_heads=max(1, min(4, H // 128)), head_dim=128,
        linear_num_key_heads=max(1, H // 256), linear_num_value_heads=max(1, H // 128),
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5ForCausalLM._from_config(config, dtype=dtype)
    tokenizer = types.SimpleNamespace(pad_token_id=0, eos_token_id=1, mask_token_id=None)
    return Target(model, tokenizer, mask_token=2)


def synthetic_items(n: int, seq_len: int, vocab: int, seed: int = 0) -> list[dict]:
    """`n` sequences of `seq_len` random tokens; the second half is the supervised "answer"."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        mask = torch.zeros(seq_len, dtype=torch.long)
        mask[seq_len // 2:] = 1
        items.append({"input_ids": torch.randint(3, vocab, (seq_len,), generator=g), "loss_mask": mask})
    return items


def throughput(target, items, cfg: TrainConfig, warmup: int) -> dict:
    """Run the real training loop; tokens/s over the steps after `warmup`."""
    stamps = []

    def on_step(step, metrics):
        sync(target.device)
        stamps.append((time.perf_counter(), metrics["tokens"]))

    result = train(cfg, target=target, items=items, on_step=on_step, handle_signals=False)
    timed = stamps[warmup:]
    seconds = timed[-1][0] - stamps[warmup - 1][0] if warmup else timed[-1][0] - timed[0][0]
    tokens = sum(t for _, t in (timed if warmup else timed[1:]))
    return {"tokens_per_s": tokens / seconds, "steps_timed": len(timed) if warmup else len(timed) - 1,
            "final_loss": result.history[-1]["loss"]}


def time_split(target, items, cfg: TrainConfig, reps: int) -> dict:
    """Median seconds per phase of one micro-batch step, taken apart from dflash.train's step."""
    from dflash.data import collate

    device = target.device
    amp_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_target(target, num_layers=cfg.drafter_layers,
                                                block_size=cfg.block_size)).to(device)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, fused=device.type == "cuda")
    batch_items = items[: cfg.batch_size]
    batch = {k: v.to(device) for k, v in collate(batch_items, 0).items()}
    anchors = [sample_anchors(it["loss_mask"], cfg.max_anchors, torch.Generator().manual_seed(anchor_seed(0, 0, i)))
               for i, it in enumerate(batch_items)]
    phases: dict[str, list[float]] = {"target forward": [], "drafter forward": [], "drafter backward": [],
                                      "optimizer step": []}
    for rep in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        blocks = build_blocks(batch["input_ids"], batch["loss_mask"], anchors, cfg.block_size, target.mask_token_id)
        B, N = blocks.anchors.shape
        context = target.context(batch["input_ids"], batch["attention_mask"])
        with torch.no_grad():
            embeds = target.embed(blocks.block_ids.view(B, N * cfg.block_size))
        sync(device)
        t1 = time.perf_counter()
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype != torch.float32):
            hidden = drafter(context, embeds, blocks.anchors, batch["attention_mask"].bool(), blocks.anchor_valid)
            loss, _ = dflash_loss_from_hidden(hidden.view(B, N, cfg.block_size, -1), target.lm_head,
                                              blocks.labels, blocks.label_valid, cfg.gamma)
        sync(device)
        t2 = time.perf_counter()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        sync(device)
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        t4 = time.perf_counter()
        if rep:  # the first repetition warms up kernels and allocators
            for name, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                phases[name].append(dt)
    med = {name: statistics.median(v) for name, v in phases.items()}
    total = sum(med.values())
    tokens = int(batch["attention_mask"].sum())
    return {"step_s": total, "tokens_per_s": tokens / total,
            "share": {name: round(v / total, 3) for name, v in med.items()},
            "seconds": {name: round(v, 5) for name, v in med.items()},
            "drafter_params": sum(p.numel() for p in drafter.parameters()), "anchors": int(blocks.anchor_valid.sum())}


def bench_one(name: str, target, args, device) -> dict:
    seq = args.seq_len if name == "large" else min(args.seq_len, 256)
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as out:
        return _bench_in(name, target, args, device, seq, out)


def _bench_in(name: str, target, args, device, seq: int, out: str) -> dict:
    cfg = TrainConfig(
        out=out, block_size=args.block_size, drafter_layers=args.drafter_layers,
        max_length=max(seq, 2 * args.block_size), max_tokens=max(seq, 2 * args.block_size) * args.batch_size,
        batch_size=args.batch_size, max_anchors=args.anchors, max_steps=args.steps + args.warmup, epochs=0,
        save_every=0, log_every=10**6, progress=False, device=str(device),
    )
    items = synthetic_items(args.batch_size * (args.steps + args.warmup), seq, target.vocab_size)
    row = {"target": name, "device": str(device), "target_params": sum(p.numel() for p in target.model.parameters()),
           "hidden": target.hidden_size, "layers": target.num_layers, "vocab": target.vocab_size,
           "seq_len": seq, "batch_size": args.batch_size, "anchors": args.anchors, "block_size": args.block_size,
           "kernels": target.kernel_report()}
    row["loop"] = throughput(target, items, cfg, args.warmup)
    row["split"] = time_split(target, items, cfg, args.reps)
    return row


def report(rows: list[dict]) -> str:
    lines = [f"{'target':<8} {'params':>8} {'seq x B':>9} {'anchors':>7} {'loop tok/s':>11} "
             f"{'target fwd':>10} {'drafter fwd':>11} {'drafter bwd':>11} {'optim':>6}"]
    for r in rows:
        s = r["split"]["share"]
        lines.append(f"{r['target']:<8} {r['target_params'] / 1e6:>7.1f}M {r['seq_len']:>5} x {r['batch_size']:<2}"
                     f" {r['split']['anchors']:>7} {r['loop']['tokens_per_s']:>11.0f} {s['target forward']:>10.1%}"
                     f" {s['drafter forward']:>11.1%} {s['drafter backward']:>11.1%} {s['optimizer step']:>6.1%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--presets", default="demo,large", help="comma list of: demo, large")
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
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    gpu = (args.device == "auto" and torch.cuda.is_available()) or args.device.startswith("cuda")
    device = torch.device("cuda" if gpu else "cpu")
    for key, on_gpu, on_cpu in (("steps", 20, 3), ("anchors", 512, 32), ("batch_size", 2, 2), ("seq_len", 4096, 256),
                                ("hidden", 2048, 256), ("layers", 16, 4), ("vocab", 151936, 8192)):
        if getattr(args, key) is None:
            setattr(args, key, on_gpu if gpu else on_cpu)
    dtype = torch.bfloat16 if gpu else torch.float32
    rows = []
    for name in [s.strip() for s in args.presets.split(",") if s.strip()]:
        if name not in ("demo", "large"):
            p.error(f"unknown preset '{name}'; choose from demo, large")
        target = demo_target(device, dtype) if name == "demo" else large_target(args, device, dtype)
        rows.append(bench_one(name, target, args, device))
        print(json.dumps(rows[-1], default=str), flush=True)
        del target
        if gpu:
            torch.cuda.empty_cache()
    print("\n" + report(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
