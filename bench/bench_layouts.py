"""The drafter layouts on one GPU at the 27B shape: shard against replicate, and what fits a 96 GB card.

    python bench/bench_layouts.py --json out.json        one H200: the 27B-shape random target (54 GB bf16)
    python bench/bench_layouts.py --preset large --hidden 1024 --layers 8 --vocab 32000   (a small try)

One process (world size 1), the trainer's own pieces: dflash.train.parallel.drafter_state wraps the drafter and builds
AdamW as `--layout` does, dflash.train.step runs each micro-batch (target forward, drafter forward and
loss, backward), then the gradient clip and the AdamW step, as the trainer does. The micro-batch is the
recipe's standard one: --batch-size 2 x --seq-len 4096 tokens, --anchors 512 per sequence, block 16, the
5-layer drafter (1.84 B parameters at the 27B shape), compiled layers, bf16 autocast, flex attention.

  1. uncapped: replicate (today's path: at world size 1 the bare drafter, no DDP) and shard (FSDP2),
     side by side; tokens/s over --steps steps after --warmup, and the ratio shard / replicate.
  2. capped at --cap-gb (torch.cuda.set_per_process_memory_fraction; 102 GB: what a 96 GB RTX PRO 6000
     Blackwell offers): replicate (expected to run out of memory, reported as such) and offload (FSDP2
     CPUOffloadPolicy: weights, gradients and AdamW state in pinned host memory, AdamW on the CPU):
     fits?, peak memory (torch.cuda.max_memory_allocated), tokens/s, and its fidelity: the last
     step's update of every parameter against AdamW's formula in float64 on the same gradients and
     state (relative error ||update - reference|| / ||reference|| over all parameters).

Prediction, written before the first measurement: shard / replicate at world size 1 = 0.95 to 1.0 (FSDP2's
gather of one rank is a copy per layer; the compiled layers are the same); replicate capped at 102 GB runs
out of memory (the 2 x 4096 x 512 micro-batch peaked at about 105 GB in bench_fit); offload fits, peak
about 78 GB (the 29 GB of fp32 drafter state leaves the GPU, one gathered layer at a time comes back),
at 0.4 to 0.6 of replicate's tokens/s (the CPU AdamW step over 1.84 B parameters and 2 x 7.4 GB of
host-device copies per step); its update matches float64 AdamW to about 1e-6 relative.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

from dflash import distributed
from dflash.config import TrainConfig
from dflash.model.drafter import Drafter, DrafterConfig
from dflash.train.parallel import drafter_state, layouts
from dflash.model.shapes import QWEN35_27B, random_target, scaled_qwen35_shape
from dflash.train.step import backward, micro_batch_sums
from dflash.train.probes.synthetic import collate_with_anchors, synthetic_items
from dflash.train.probes.timing import free_memory


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def reference_update(opt: torch.optim.AdamW) -> dict:
    """Before opt.step(): each parameter's AdamW update in float64 from its gradient and state."""
    group = opt.param_groups[0]
    (b1, b2), lr, eps, wd = group["betas"], group["lr"], group["eps"], group["weight_decay"]
    ref = {}
    for p in group["params"]:
        st = opt.state[p]
        step = float(local(st["step"]) if torch.is_tensor(st["step"]) else st["step"]) + 1
        p0, g = local(p.detach()).cpu().clone(), local(p.grad).double().cpu()
        m = b1 * local(st["exp_avg"]).double().cpu() + (1 - b1) * g
        v = b2 * local(st["exp_avg_sq"]).double().cpu() + (1 - b2) * g * g
        new = p0.double() * (1 - lr * wd) - lr * (m / (1 - b1 ** step)) / ((v / (1 - b2 ** step)).sqrt() + eps)
        ref[p] = (p0, new - p0.double())
    return ref


def relative_error(ref: dict) -> float:
    err = tot = 0.0
    for p, (p0, want) in ref.items():
        got = local(p.detach()).double().cpu() - p0.double()
        err += float((got - want).pow(2).sum())
        tot += float(want.pow(2).sum())
    return (err / max(tot, 1e-300)) ** 0.5


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_layout(layout: str, target, dcfg, batch, anchors, d, args, cap_gb: float | None) -> dict:
    row = {"layout": layout, "cap_gb": cap_gb}
    drafter = opt = None
    cuda = d.device.type == "cuda"
    fidelity = layout == "offload"
    try:
        torch.manual_seed(0)
        with torch.device(d.device):
            drafter = Drafter(dcfg, attention="flex" if cuda else "sdpa")
        config = TrainConfig.from_flat(layout=layout, device=str(d.device.type))
        state = drafter_state.of(config.layout)
        model = state.wrap(drafter, d, compile=cuda and not args.no_compile)
        opt = state.optimizer(drafter, config, d)
        if cuda:
            torch.cuda.reset_peak_memory_stats(d.device)
        times = []
        for i in range(args.warmup + args.steps):
            sync(d.device)
            t0 = time.perf_counter()
            sums = micro_batch_sums(model, target, batch, anchors, block_size=dcfg.block_size, gamma=None,
                                    autocast_dtype=torch.bfloat16 if cuda else torch.float32)
            backward(sums, d, grad_accum=1)
            layouts.clip_grad_norm(drafter, 1.0)
            ref = reference_update(opt) if fidelity and i == args.warmup + args.steps - 1 else None
            opt.step()
            sync(d.device)
            times.append(time.perf_counter() - t0)
            if ref is not None:
                row["update_rel_err_vs_fp64_adamw"] = relative_error(ref)
            opt.zero_grad(set_to_none=True)
            print(f"  {layout} step {i}: {times[-1]:.3f} s loss {float(sums.loss_sum / sums.weight):.4f}", flush=True)
        step_s = sorted(times[args.warmup:])[len(times[args.warmup:]) // 2]
        tokens = int(batch["attention_mask"].sum())
        row.update(fits=True, step_s=step_s, tokens_per_s=tokens / step_s, first_step_s=times[0])
        if cuda:
            row.update(peak_gb=torch.cuda.max_memory_allocated(d.device) / 1e9,
                       reserved_gb=torch.cuda.max_memory_reserved(d.device) / 1e9)
    except torch.OutOfMemoryError as exc:
        row.update(fits=False, error=str(exc).split("\n")[0][:300])
    finally:
        del drafter, opt
        gc.collect()
        free_memory(d.device)
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="27b", choices=("27b", "large"))
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (the first compiles)")
    p.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    p.add_argument("--cap-gb", type=float, default=102.0)
    p.add_argument("--uncapped", default="replicate,shard")
    p.add_argument("--capped", default="replicate,offload")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--device", default="cuda", help="cpu: a check of the script at a small --preset large")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --device cpu to check the script at a small size)")
    with distributed.joined(args.device, group_alone=True, host_collectives=args.device == "cuda") as d:
        cuda = d.device.type == "cuda"
        shape = QWEN35_27B if args.preset == "27b" else scaled_qwen35_shape(args.hidden, args.layers, args.vocab)
        target = random_target(shape, d.device, torch.bfloat16 if cuda else torch.float32)
        dcfg = DrafterConfig.from_target(target, num_hidden_layers=5, block_size=16)
        batch, anchors = collate_with_anchors(synthetic_items(args.batch_size, args.seq_len, target.vocab_size),
                                              args.anchors, d.device)
        total = torch.cuda.get_device_properties(d.device).total_memory / 1e9 if cuda else float("nan")
        rows = []
        for layout in filter(None, args.uncapped.split(",")):
            rows.append(run_layout(layout, target, dcfg, batch, anchors, d, args, None))
        if cuda:
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gb / total), d.device)
        for layout in filter(None, args.capped.split(",")):
            rows.append(run_layout(layout, target, dcfg, batch, anchors, d, args, args.cap_gb if cuda else None))
        base = next((r for r in rows if r["layout"] == "replicate" and r.get("fits") and r["cap_gb"] is None), None)
        print(f"\ncard {total:.0f} GB; micro-batch {args.batch_size} x {args.seq_len} tokens, "
              f"{args.anchors} anchors/seq")
        print(f"{'layout':<10} {'cap GB':>7} {'fits':>5} {'peak GB':>8} {'step s':>7} {'tok/s':>7} "
              f"{'vs replicate':>12}")
        for r in rows:
            ratio = r["tokens_per_s"] / base["tokens_per_s"] if base and r.get("fits") else float("nan")
            cap = f"{r['cap_gb']:.0f}" if r["cap_gb"] else "-"
            print(f"{r['layout']:<10} {cap:>7} {str(r['fits']):>5} {r.get('peak_gb', float('nan')):>8.1f} "
                  f"{r.get('step_s', float('nan')):>7.3f} {r.get('tokens_per_s', float('nan')):>7.0f} {ratio:>12.3f}")
            if "update_rel_err_vs_fp64_adamw" in r:
                print(f"  {r['layout']} update vs float64 AdamW on the same gradients: relative error "
                      f"{r['update_rel_err_vs_fp64_adamw']:.2e}")
        if args.json:
            record = {"card_gb": total, "args": vars(args), "rows": rows}
            Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
