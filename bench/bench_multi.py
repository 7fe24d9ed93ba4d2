"""Several drafters on one target pass: drafter-steps per second for K = 1, 2, 3 against K separate runs,
side by side in one run, and where the drafter forward's time goes (torch.profiler).

    python bench/bench_multi.py --preset 27b --json out.json --profile-out prof.txt     (one H200)
    python bench/bench_multi.py                                  (a small random target on the CPU: smoke)

What is measured, all in one process on one random target (dflash.model.shapes; 27b = Qwen3.5-27B's shape,
26.9B parameters, bf16; 2 sequences x 4096 tokens, 512 anchors per sequence, block 16, 5-layer drafters):
  K = 1   the training loop with one drafter (dflash.train.loop.TrainingLoop._optimizer_step); K
          separate runs of such a drafter do K drafter-steps in K times its step time.
  K = 2,3 the same loop with K drafters of the same shape: one target
          forward per micro-batch, then each drafter's forward, backward and optimizer step.
  speed-up = (K / seconds of a K-drafter step) / (1 / seconds of a K = 1 step): drafter-steps per second
  against K separate runs. Medians of --steps steps after --warmup (each step CUDA-synchronised).
When K drafters do not fit (the first micro-batch runs out of memory), the row says so and the whole K
series is measured again with smaller drafters (--fallback-layers), so that every K runs the same shape.
The drafter forward is then profiled at the same shape (compiled layers, flex attention, the fused head and
loss, as in training): its median time and share of the bf16 peak measured in this run, and the top
kernels by CUDA time with their share of the forward.

Prediction (written before the run, from the phase costs measured at this shape on one H200: target forward
0.826 s, drafter forward 0.252 s, backward 0.300 s, optimizer 0.016 s per micro-batch, so a step of one
drafter is 1.394 s and each further drafter adds 0.568 s):
  K = 2: 2 x 1.394 / (1.394 + 0.568) = 1.42x the drafter-steps per second of separate runs
  K = 3: 3 x 1.394 / (1.394 + 2 x 0.568) = 1.65x
Memory: one 5-layer drafter at this shape has 1.84B parameters, 29.4 GB of fp32 weights, gradients and
AdamW moments; three of them (88 GB) beside the 54 GB target leave about 8 GB of the H200's 150 GB for
activations, under what one micro-batch of 2 x 4096 tokens needs, so K = 3 is expected not to fit with
5-layer drafters: the fallback measures K = 1, 2, 3 with 3-layer drafters (1.15B parameters, 18.5 GB each).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflash import distributed
from dflash.config import TrainConfig
from dflash.config.drafters import DrafterSpec, drafter_configs
from dflash.errors import TrainError
from dflash.train.probes.mfu import batch_flops
from dflash.train.loop import TrainingLoop
from dflash.model.shapes import QWEN35_27B, random_target, scaled_qwen35_shape
from dflash.train.signals import StopFlag
from dflash.train.step import micro_batch_sums
from dflash.train.probes.synthetic import synthetic_items
from dflash.train.probes.timing import free_memory, matmul_peak, sync
from dflash.train.setup import auto_precision


def run_config(out: str, args, layers: int, device: torch.device) -> TrainConfig:
    return TrainConfig.from_flat(
        out=out, block_size=16, drafter_layers=layers, max_length=args.seq_len, max_tokens=args.seq_len * args.batch,
        batch_size=args.batch, max_anchors=args.anchors, max_steps=args.warmup + args.steps, epochs=0, save_every=0,
        log_every=10**6, progress=False, device=str(device))


def step_seconds(step, device, warmup: int, steps: int) -> list[float]:
    """Seconds of each of `steps` optimizer steps after `warmup` (CUDA synchronised around each)."""
    out = []
    for i in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def measure_k(k: int, target, items, args, layers: int, device, d) -> dict:
    """Median seconds of an optimizer step training k drafters on one target pass."""
    row = {"k": k, "drafter_layers": layers}
    with tempfile.TemporaryDirectory(prefix=f"bench-multi-k{k}-") as out:
        config = run_config(out, args, layers, device)
        trainer = None
        try:
            configs = ({"": config} if k == 1 else
                       drafter_configs(config, [DrafterSpec(f"d{i}", {"lr": 6e-4 * (i + 1)}) for i in range(k)]))
            trainer = TrainingLoop(configs, target, items, d, StopFlag())
            trainer.heartbeat = None
            for lane in trainer.lanes.values():
                lane.drafter.train()
            times = step_seconds(trainer._optimizer_step, device, args.warmup, args.steps)
            row.update(step_s=statistics.median(times), steps_s=[round(t, 4) for t in times])
            if device.type == "cuda":
                row["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
        except (TrainError, torch.OutOfMemoryError) as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            del trainer
            free_memory(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
    return row


def profile_forward(target, items, args, device, peak: float | None, profile_out: str | None) -> dict:
    """The drafter forward (+ fused head and loss) at the run's shape: median ms, share of the bf16 peak, and
    the top CUDA kernels by time (torch.profiler) with their share of the forward's kernel time."""
    from torch.profiler import ProfilerActivity, profile

    with tempfile.TemporaryDirectory(prefix="bench-multi-prof-") as out:
        config = run_config(out, args, args.layers, device)
        loop = TrainingLoop({"": config}, target, items, distributed.Dist(0, 1, 0, device), StopFlag())
        trainer = loop.first
        epoch, indices = trainer.order.next()
        rank_batch, context = loop.take(epoch, indices)  # as the loop makes them, by the run's batching
        batch, anchors = rank_batch.batch, trainer.anchors(rank_batch, epoch)
        n_anchors = loop.batching.n_anchors
        state = {"drafter": trainer.drafter, "context": context}

        def forward():
            return micro_batch_sums(state["drafter"], target, batch, anchors, block_size=16, gamma=None,
                                    autocast_dtype=trainer.autocast_dtype, context=state["context"],
                                    n_anchors=n_anchors)

        for _ in range(3):
            forward().loss_sum.backward()  # compile forward and backward, as training does
            trainer.drafter.zero_grad(set_to_none=True)
        times = []
        for _ in range(5):
            sync(device)
            t0 = time.perf_counter()
            sums = forward()
            sync(device)
            times.append(time.perf_counter() - t0)
            del sums
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(3):
                sums = forward()
                sync(device)
                del sums
        flops = batch_flops(target, batch, anchors, trainer.drafter_config)
        fwd_flops = flops["drafter"] / 3 + flops["lm_head"] / 2
        state.clear()
        trainer.drafter = trainer.model = trainer.optimizer = None
        del context
    free_memory(device)
    averages = prof.key_averages()
    if device.type == "cuda":  # the kernels themselves: the operators above them would count their time twice
        attr = "device_time_total"
        events = [e for e in averages if "CUDA" in str(getattr(e, "device_type", "")) and getattr(e, attr, 0) > 0]
        if not events:
            attr = "self_device_time_total"
            events = [e for e in averages if getattr(e, attr, 0) > 0]
    else:
        attr = "self_cpu_time_total"
        events = [e for e in averages if getattr(e, attr, 0) > 0]
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    total = sum(getattr(e, attr) for e in events) or 1.0
    top = [{"kernel": e.key[:120], "ms_per_forward": round(getattr(e, attr) / 3 / 1e3, 3),
            "share": round(getattr(e, attr) / total, 4), "calls_per_forward": e.count // 3} for e in events[:15]]
    if profile_out:
        sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        Path(profile_out).write_text(prof.key_averages().table(sort_by=sort, row_limit=40) + "\n")
    med = statistics.median(times)
    row = {"forward_ms": round(med * 1e3, 2), "forward_tflops": round(fwd_flops / med / 1e12, 1), "top_kernels": top,
           "kernel_ms_per_forward": round(total / 3 / 1e3, 2)}
    if peak:
        row["forward_share_of_peak"] = round(fwd_flops / med / 1e12 / peak, 3)
    return row


def table(rows: list[dict]) -> str:
    lines = [f"{'layers':>6} {'K':>2} {'step s':>8} {'drafter-steps/s':>16} {'vs K separate runs':>19} {'peak GiB':>9}"]
    base = {r["drafter_layers"]: r["step_s"] for r in rows if r["k"] == 1 and "step_s" in r}
    for r in rows:
        if "step_s" not in r:
            lines.append(f"{r['drafter_layers']:>6} {r['k']:>2}  does not fit: {r['error'][:90]}")
            continue
        one = base.get(r["drafter_layers"])
        ratio = f"{r['k'] * one / r['step_s']:.2f}x" if one else "-"
        lines.append(f"{r['drafter_layers']:>6} {r['k']:>2} {r['step_s']:>8.3f} {r['k'] / r['step_s']:>16.3f} "
                     f"{ratio:>19} {r.get('peak_gib', '-'):>9}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default=None, help="27b (default on a GPU) or small (default on a CPU)")
    p.add_argument("--ks", default="1,2,3")
    p.add_argument("--layers", type=int, default=5, help="drafter layers")
    p.add_argument("--fallback-layers", type=int, default=3, help="drafter layers when K drafters do not fit (0: none)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=None, help="default: 4096 (27b), 256 (small)")
    p.add_argument("--anchors", type=int, default=None, help="per sequence; default: 512 (27b), 16 (small)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--deadline-s", type=float, default=0, help="start no further measurement after this many "
                   "seconds (0: none): a run cut short still prints its table")
    p.add_argument("--json")
    p.add_argument("--profile-out", help="torch.profiler's table of the drafter forward")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    preset = args.preset or ("27b" if gpu else "small")
    args.seq_len = args.seq_len or (4096 if preset == "27b" else 256)
    args.anchors = args.anchors or (512 if preset == "27b" else 16)
    ks = [int(k) for k in args.ks.split(",")]
    peak = matmul_peak(device) if gpu else None
    t0 = time.perf_counter()
    shape = QWEN35_27B if preset == "27b" else scaled_qwen35_shape(128, 4, 4096)
    target = random_target(shape, device, auto_precision(device))
    print(json.dumps({"target_built_s": round(time.perf_counter() - t0, 1), "peak_tflops": peak}), flush=True)
    items = synthetic_items(args.batch * (args.warmup + args.steps) + args.batch, args.seq_len, target.vocab_size)
    d = distributed.Dist(rank=0, world_size=1, local_rank=0, device=device)
    result = {"preset": preset, "device": torch.cuda.get_device_name(device) if gpu else "cpu", "peak_tflops": peak,
              "batch": args.batch, "seq_len": args.seq_len, "anchors_per_seq": args.anchors, "block_size": 16,
              "rows": []}
    if args.profile_out is not None or gpu:
        result["profile"] = profile_forward(target, items, args, device, peak, args.profile_out)
        print(json.dumps(result["profile"]), flush=True)
    for layers in [args.layers] + ([args.fallback_layers] if args.fallback_layers else []):
        for k in ks:
            if args.deadline_s and time.perf_counter() - t0 > args.deadline_s:
                print(json.dumps({"skipped": f"K={k}, {layers} layers: past --deadline-s"}), flush=True)
                continue
            row = measure_k(k, target, items, args, layers, device, d)
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        if all("step_s" in r or "skipped" in r for r in result["rows"] if r["drafter_layers"] == layers):
            break  # every K fitted: no fallback needed
    print("\n" + table(result["rows"]))
    if "profile" in result:
        pr = result["profile"]
        share = f", {pr['forward_share_of_peak']:.0%} of the measured bf16 peak" if "forward_share_of_peak" in pr else ""
        print(f"\ndrafter forward: {pr['forward_ms']} ms, {pr['forward_tflops']} TFLOP/s{share}; top kernels:")
        for kern in pr["top_kernels"][:10]:
            print(f"  {kern['share']:6.1%} {kern['ms_per_forward']:8.2f} ms x{kern['calls_per_forward']:<3} {kern['kernel'][:90]}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
