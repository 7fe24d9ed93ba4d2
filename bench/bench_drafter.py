"""The drafter's training micro-batch alone, at a real target's shape: the step's variants side by side.

    python bench/bench_drafter.py                          27B shape on a GPU: before, fused-head, compiled, after
    python bench/bench_drafter.py --numerics               + each variant's gradients against an fp32 reference
    python bench/bench_drafter.py --shape tiny --device cpu --variants before,fused-head   (a CPU smoke run)

What runs is the trainer's own step, dflash.train.step.micro_batch_sums + backward, with
dflash.train.probes.step_numerics.StandInTarget in place of the frozen target: the tapped hidden states are random
[B,T,k*H], the embedding and the LM head random [V,H] tables of the target's shape and dtype. The drafter,
the head and the loss do all the work, which is what is timed here (the target's forward is bench_train's).
Shapes: dflash.model.shapes.STEP_SHAPES; the batch: dflash.train.probes.synthetic.synthetic_batch.

Variants (dflash.train.probes.step_numerics.STEP_VARIANTS; every one starts from the same initial weights, anchors
and inputs):
  before      eager decoder layers, LM head in checkpointed chunks (losses.weighted_ce_from_hidden)
  fused-head  eager layers, LM head fused with the loss (dflash.objective.head_loss)
  compiled    Drafter.compile_layers (regional torch.compile), checkpointed head
  after       compiled layers + fused head: what the trainer runs on a GPU
For each: median seconds of --reps micro-batches after --warmup (a CUDA sync around each phase), for
forward+loss and backward; their model TFLOP/s (dflash.train.probes.mfu: the drafter's 3x forward split 1:2, the
head's 2 products 1:1) and share of a bf16 matmul peak measured in the same run; the peak memory the
micro-batch adds over what was allocated before it (weights, inputs), and the absolute peak.

--numerics: each variant's parameter gradients for one micro-batch against an fp32 reference step on the
same weights and inputs (bf16 inputs upcast): fp32 weights and activations, no autocast, TF32 off, dense
masked SDPA on the memory-efficient kernel, the head in checkpointed fp32 chunks. Cosine and relative L2
error per parameter group (dflash.train.probes.step_numerics). The reference is first checked against a float64 step
at a small shape.
--profile NAMES: one micro-batch of each variant named under torch.profiler: GPU time by kernel family, the
busy share of the wall time, and the host syncs (torch.cuda sync debug mode).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from dflash.model.drafter import DrafterConfig
from dflash.train.probes import mfu as flops
from dflash.train.probes.step_numerics import (STEP_VARIANTS, StandInTarget, compare, gradients, new_drafter, one_step,
                                   reference_gradients)
from dflash.model.shapes import STEP_SHAPES, drafter_config
from dflash.train.probes.synthetic import synthetic_batch
from dflash.train.probes.timing import free_memory, matmul_peak, sync
from dflash.train.setup import auto_precision


def step_flops(dcfg: DrafterConfig, anchors: list[torch.Tensor], batch: dict) -> dict:
    """Model FLOPs of the drafter micro-batch: forward+loss and backward (dflash.train.probes.mfu' formulas)."""
    items = [{"input_ids": ids, "loss_mask": mask} for ids, mask in zip(batch["input_ids"].cpu(), batch["loss_mask"].cpu())]
    drafter, head = flops.drafter_and_head_flops(dcfg, items, anchors)
    return {"forward": drafter / 3 + head / 2, "backward": 2 * drafter / 3 + head / 2, "drafter": drafter,
            "lm_head": head, "scored_rows": round(head / flops.head_flops(dcfg, 1)),
            "block_rows": sum(int(a.numel()) for a in anchors) * dcfg.block_size}


def time_variant(name: str, dcfg, target, batch, anchors, args, device, state, peak) -> dict:
    v = STEP_VARIANTS[name]
    drafter = new_drafter(dcfg, device, args.attention, v["compiled"], state)
    autocast = auto_precision(device)
    fwd, bwd, added, absolute = [], [], 0, 0
    for rep in range(args.warmup + args.reps):
        drafter.zero_grad(set_to_none=True)
        if device.type == "cuda":
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        f, b = one_step(drafter, target, batch, anchors, dcfg, autocast, v["fused_head"], device)
        if rep >= args.warmup:
            fwd.append(f)
            bwd.append(b)
            if device.type == "cuda":
                absolute = max(absolute, torch.cuda.max_memory_allocated(device))
                added = max(added, absolute - before)
    del drafter
    free_memory(device)
    f, b = statistics.median(fwd), statistics.median(bwd)
    fl = step_flops(dcfg, anchors, batch)
    row = {"variant": name, **v, "forward_s": f, "backward_s": b, "step_s": f + b,
           "forward_s_all": fwd, "backward_s_all": bwd,
           "tflops": {"forward": fl["forward"] / f / 1e12, "backward": fl["backward"] / b / 1e12,
                      "step": (fl["forward"] + fl["backward"]) / (f + b) / 1e12},
           "peak_memory_added_gb": added / 1e9, "peak_memory_gb": absolute / 1e9}
    if peak:
        row["share_of_peak"] = {k: x / peak for k, x in row["tflops"].items()}
    return row


# ---- numerics ----------------------------------------------------------------------------------------
def numerics(dcfg, target, batch, anchors, args, device, state, names) -> dict:
    """Each variant's gradients against the fp32 reference; the reference against float64 at a small shape."""
    out = {}
    small = dict(STEP_SHAPES["tiny"] if args.shape == "tiny" else STEP_SHAPES["small"], seq=256, anchors=16)
    scfg = drafter_config(small, 2, dcfg.block_size)
    s_target = StandInTarget(small, device, torch.bfloat16, 5)
    s_batch, s_anchors = synthetic_batch(small, device)
    s_state = {k: v.double() for k, v in new_drafter(scfg, device, "sdpa", False).state_dict().items()}
    r64 = reference_gradients(scfg, small, s_target, s_batch, s_anchors, device, s_state, torch.float64)
    r32 = reference_gradients(scfg, small, s_target, s_batch, s_anchors, device,
                              {k: v.float() for k, v in s_state.items()})
    out["reference_vs_float64_small_shape"] = compare(r32, r64)["all"]
    del r64, r32
    ref = reference_gradients(dcfg, args.s, target, batch, anchors, device, state)
    autocast = auto_precision(device)
    for name in names:
        v = STEP_VARIANTS[name]
        drafter = new_drafter(dcfg, device, args.attention, v["compiled"], state)
        one_step(drafter, target, batch, anchors, dcfg, autocast, v["fused_head"], device)
        out[name] = compare(gradients(drafter), ref)
        del drafter
        free_memory(device)
    return out


# ---- profile ----------------------------------------------------------------------------------------
FAMILIES = (("flex attention", ("flex", "triton_tem")), ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "sm90")),
            ("sdpa", ("fmha", "flash", "efficient_attention")), ("fused (triton)", ("triton_",)),
            ("cast/copy", ("copy", "cast", "to_copy")), ("reduce", ("reduce", "norm", "sum", "max", "softmax")),
            ("elementwise", ("elementwise", "vectorized", "unrolled")))


def profile(name, dcfg, target, batch, anchors, args, device, state) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    v = STEP_VARIANTS[name]
    drafter = new_drafter(dcfg, device, args.attention, v["compiled"], state)
    autocast = auto_precision(device)
    for _ in range(2):
        drafter.zero_grad(set_to_none=True)
        one_step(drafter, target, batch, anchors, dcfg, autocast, v["fused_head"], device)
    drafter.zero_grad(set_to_none=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        t = time.perf_counter()
        one_step(drafter, target, batch, anchors, dcfg, autocast, v["fused_head"], device)
        wall = time.perf_counter() - t
    families: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time_total / 1e3
        lower = e.name.lower()
        family = next((f for f, keys in FAMILIES if any(k in lower for k in keys)), "other")
        families[family] = families.get(family, 0.0) + e.device_time_total / 1e3
    busy = sum(families.values())
    # host syncs: the sync debug mode warns once per synchronising call
    drafter.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn") if device.type == "cuda" else None
        try:
            one_step(drafter, target, batch, anchors, dcfg, autocast, v["fused_head"], device)
        finally:
            torch.cuda.set_sync_debug_mode(0) if device.type == "cuda" else None
    syncs = [str(w.message).splitlines()[0][:160] for w in caught if "synchroniz" in str(w.message).lower()]
    del drafter
    free_memory(device)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {"variant": name, "wall_ms": wall * 1e3, "gpu_busy_ms": busy, "families_ms": families,
            "top_kernels_ms": top, "host_syncs": len(syncs), "host_sync_messages": syncs[:10]}


def report(rows: list[dict], peak: float | None) -> str:
    lines = [f"{'variant':<11} {'fwd+loss ms':>11} {'bwd ms':>8} {'step ms':>8} {'TFLOP/s':>8} {'of peak':>8} "
             f"{'fwd TF/s':>9} {'bwd TF/s':>9} {'mem +GB':>8} {'peak GB':>8}"]
    for r in rows:
        share = f"{r['share_of_peak']['step']:.1%}" if "share_of_peak" in r else "-"
        lines.append(f"{r['variant']:<11} {r['forward_s'] * 1e3:>11.1f} {r['backward_s'] * 1e3:>8.1f} "
                     f"{r['step_s'] * 1e3:>8.1f} {r['tflops']['step']:>8.1f} {share:>8} {r['tflops']['forward']:>9.1f} "
                     f"{r['tflops']['backward']:>9.1f} {r['peak_memory_added_gb']:>8.2f} {r['peak_memory_gb']:>8.2f}")
    by = {r["variant"]: r for r in rows}
    if "before" in by:
        for r in rows:
            if r["variant"] != "before":
                lines.append(f"{r['variant']}: {by['before']['step_s'] / r['step_s']:.2f}x the step of 'before'")
    if peak:
        lines.append(f"bf16 matmul peak measured in this run: {peak:.0f} TFLOP/s")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", default="27b", choices=sorted(STEP_SHAPES), help="target shape (and tokens, anchors)")
    p.add_argument("--variants", default="before,fused-head,compiled,after", help=f"comma list of: {', '.join(STEP_VARIANTS)}")
    p.add_argument("--device", default="auto", help="'auto' (cuda if there), 'cpu', 'cuda'")
    p.add_argument("--attention", default=None, help="drafter attention (default: flex on GPU, sdpa on CPU)")
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=None, help="sequences per micro-batch (default: the shape's)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the shape's)")
    p.add_argument("--anchors", type=int, default=None, help="max anchors per sequence (default: the shape's)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--numerics", action="store_true", help="gradients against an fp32 reference step")
    p.add_argument("--profile", default=None, help="comma list of variants to profile (one micro-batch each)")
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    profiled = [n.strip() for n in (args.profile or "").split(",") if n.strip()]
    for n in names + profiled:
        if n not in STEP_VARIANTS:
            p.error(f"unknown variant '{n}'; choose from {', '.join(STEP_VARIANTS)}")
    gpu = (args.device == "auto" and torch.cuda.is_available()) or args.device.startswith("cuda")
    device = torch.device("cuda") if gpu else torch.device("cpu")
    args.attention = args.attention or ("flex" if gpu else "sdpa")
    s = dict(STEP_SHAPES[args.shape])
    for key, arg in (("batch", args.batch_size), ("seq", args.seq_len), ("anchors", args.anchors)):
        if arg is not None:
            s[key] = arg
    args.s = s
    dcfg = drafter_config(s, args.drafter_layers, args.block_size)
    dtype = auto_precision(device)
    target = StandInTarget(s, device, dtype, len(dcfg.target_layer_ids))
    batch, anchors = synthetic_batch(s, device)
    state = {k: v.clone() for k, v in new_drafter(dcfg, device, args.attention, False).state_dict().items()}
    free_memory(device)
    peak = None
    if gpu:
        peak = matmul_peak(device)
        print(f"bf16 matmul peak: {peak:.0f} TFLOP/s", flush=True)
    fl = step_flops(dcfg, anchors, batch)
    print(json.dumps({"shape": args.shape, **s, "attention": args.attention, "flops_tf": {k: v / 1e12 for k, v in fl.items() if "rows" not in k},
                      "scored_rows": fl["scored_rows"], "block_rows": fl["block_rows"]}),
          flush=True)
    result: dict = {"shape": s, "flops": fl, "peak_tflops": peak, "variants": []}
    for name in names:
        try:
            row = time_variant(name, dcfg, target, batch, anchors, args, device, state, peak)
        except Exception as exc:  # one failing variant must not lose the others' figures
            row = {"variant": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            free_memory(device)
        print(json.dumps(row), flush=True)
        if "error" not in row:
            result["variants"].append(row)
    print("\n" + report(result["variants"], peak), flush=True)
    for name in profiled:
        result.setdefault("profile", {})[name] = prof = profile(name, dcfg, target, batch, anchors, args, device, state)
        print(json.dumps(prof, indent=1), flush=True)
    if args.numerics:
        result["numerics"] = numerics(dcfg, target, batch, anchors, args, device, state, names)
        print(json.dumps(result["numerics"], indent=1), flush=True)
        for name in names:
            g = result["numerics"][name]
            print(f"numerics {name:<11} cosine {g['all']['cosine']:.6f}  rel L2 {g['all']['rel_l2']:.4f}  "
                  + "  ".join(f"{k} {x['cosine']:.5f}/{x['rel_l2']:.4f}" for k, x in g.items() if k != "all"))
        print(f"reference fp32 vs float64 (small shape): {result['numerics']['reference_vs_float64_small_shape']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
