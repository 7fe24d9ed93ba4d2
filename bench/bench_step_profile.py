"""Where one packed training step's GPU time goes: the real loop (`dflash.train.trainer.train`) on packed rows
of a chat-like mix, one step after warm-up under torch.profiler.

    python bench/bench_step_profile.py --preset 27b --fp8-target --json prof.json      one H100: 27B, FP8 target
    python bench/bench_step_profile.py --preset 27b --fp8-target --target-layers 16    fewer target layers
    python bench/bench_step_profile.py                                                 CPU, toy size

Reported for the profiled step: its wall time between two synchronised step ends, the GPU's busy time (the
union of every kernel's interval) and so its idle share; the GPU time of each phase, cut by a one-thread
marker kernel launched in stream order at each phase edge (target forward, drafter forward, LM head + loss
forward, LM head backward, drafter backward, optimizer step, the rest: data, anchors, block building); and
each kernel family's share (FP8 GEMMs, bf16 GEMMs, activation quantisation, GatedDeltaNet kernels,
attention, compiled elementwise, ...) overall and per phase. The raw table ({phase: {kernel: [ms, count]}})
goes to --json so families can be drawn again from it. The profiler adds host time to every launch, so the
idle share under it is an upper bound; the steps around it are timed without it (median_step_s).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_length_mix import LEVERS, chat_mix, items_of, undo_levers  # noqa: E402
from dflash.config import TrainConfig  # noqa: E402
from dflash.kinds import DEFAULT, names  # noqa: E402
from dflash.model.fp8 import pick_gemm, quantize_model, use_fp8_gemm  # noqa: E402
from dflash.model.fp8_checkpoint import default_modules_to_not_convert  # noqa: E402
from dflash.model.shapes import QWEN35_27B, random_target, scaled_qwen35_shape  # noqa: E402
from dflash.train.probes.timing import free_memory, sync  # noqa: E402

# Kernel families by name (lower case), first match wins. cuBLASLt's block-scaled FP8 kernels carry the
# operand type (e4m3); fla's GatedDeltaNet kernels are named after the chunked delta rule's stages.
FAMILIES = (
    ("marker", ("phase_marker",)),
    ("fp8 quantise", ("_quantize_kernel",)),
    ("fp8 gemm", ("nvjet_sm90_qq", "e4m3", "f8", "fp8", "qgmma", "_block_fp8_kernel")),  # nvjet "qq": fp8 A, B
    ("causal conv1d", ("causal_conv1d", "conv1d", "conv_depthwise")),
    ("gated delta rule", ("chunk_", "solve_tril", "recompute_w_u", "merge_16x16", "l2norm", "gdn", "delta_rule",
                          "fused_recurrent", "prepare_wy", "cumsum", "kkt", "wy_fast")),
    ("attention", ("flash", "fmha", "flex", "attention", "sdpa", "triton_tem")),
    ("gemm (bf16)", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "wgmma", "cublas")),
    ("compiled (inductor)", ("triton_poi", "triton_per", "triton_red")),
    ("norm/reduce", ("norm", "reduce", "softmax", "sum", "max", "mean")),
    ("copy/cast", ("copy", "catarray", "memcpy", "memset", "index", "gather", "scatter", "fill")),  # dtype casts are copies
    ("elementwise", ("elementwise", "vectorized", "unrolled", "silu", "mul", "add", "pow")),
)
PHASES = ("rest", "target forward", "drafter forward", "head+loss forward", "head backward", "drafter backward",
          "optimizer")


def family(name: str) -> str:
    lower = name.lower()
    return next((f for f, keys in FAMILIES if any(k in lower for k in keys)), "other")


try:  # a GPU machine's torch brings Triton
    import triton
    import triton.language as tl

    @triton.jit
    def phase_marker_kernel(p):
        tl.store(p, 1)
except ImportError:
    phase_marker_kernel = None


class Markers:
    """A one-thread Triton kernel launched at each phase edge, in stream order, with the phase it opens; the
    profiler's trace then cuts the GPU timeline at those kernels' starts."""

    def __init__(self, device):
        self.buf, self.opened, self.on = torch.zeros(1, device=device), [], False
        phase_marker_kernel[(1,)](self.buf)

    def __call__(self, phase: str) -> None:
        if self.on:
            phase_marker_kernel[(1,)](self.buf)
            self.opened.append(phase)


def wrap(fn, before: str, after: str, mark: Markers):
    @functools.wraps(fn)
    def run(*a, **k):
        mark(before)
        try:
            return fn(*a, **k)
        finally:
            mark(after)
    return run


def instrument(target, mark: Markers) -> None:
    """Phase edges around the target pass, the fused head's forward and backward, the backward and the
    optimizer step (module attributes the loop looks up at call time)."""
    import dflash.train.lane as lane
    from dflash.objective import head_loss

    target.context = wrap(target.context, "target forward", "rest", mark)
    head_loss._HeadCE.forward = staticmethod(wrap(head_loss._HeadCE.forward, "head+loss forward",
                                                  "drafter forward", mark))
    head_loss._HeadCE.backward = staticmethod(wrap(head_loss._HeadCE.backward, "head backward",
                                                   "drafter backward", mark))
    lane.backward = wrap(lane.backward, "drafter backward", "rest", mark)
    lane.Lane._apply_step = wrap(lane.Lane._apply_step, "optimizer", "rest", mark)
    lane.micro_batch_sums = wrap(lane.micro_batch_sums, "drafter forward", "rest", mark)


def union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total / 1e3


def analyse(prof, opened: list[str], wall_s: float) -> dict:
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start), key=lambda k: k[0])
    edges = [s for s, _, n in kernels if "phase_marker" in n]
    if len(edges) != len(opened):
        print(f"warning: {len(edges)} marker kernels for {len(opened)} phase edges", file=sys.stderr)
    table: dict[str, dict[str, list]] = {}
    spans: dict[str, list] = {}
    for s, e, n in kernels:
        i = sum(1 for edge in edges if edge <= s) - 1
        phase = opened[i] if 0 <= i < len(opened) else "rest"
        cell = table.setdefault(phase, {}).setdefault(n, [0.0, 0])
        cell[0] += (e - s) / 1e3
        cell[1] += 1
        spans.setdefault(phase, []).append((s, e))
    busy = union_ms([(s, e) for s, e, _ in kernels])
    windows = {}
    cuts = edges + [kernels[-1][1]] if kernels else []
    for i, phase in enumerate(opened[:len(edges)]):
        windows[phase] = windows.get(phase, 0.0) + (cuts[i + 1] - cuts[i]) / 1e3
    fams: dict[str, dict[str, float]] = {}
    for phase, ks in table.items():
        for n, (ms, _) in ks.items():
            f = fams.setdefault(family(n), {})
            f[phase] = f.get(phase, 0.0) + ms
    top = sorted(((n, ms, c, phase) for phase, ks in table.items() for n, (ms, c) in ks.items()), key=lambda r: -r[1])
    return {"wall_ms": wall_s * 1e3, "gpu_busy_ms": busy, "gpu_idle_share": 1 - busy / (wall_s * 1e3),
            "phase_window_ms": windows,
            "phase_busy_ms": {p: union_ms(v) for p, v in spans.items()},
            "families_ms": fams, "kernel_launches": len(kernels),
            "top_kernels": [{"name": n[:160], "ms": round(ms, 3), "count": c, "phase": p, "family": family(n)}
                            for n, ms, c, p in top[:60]],
            "table": {p: {n[:200]: [round(ms, 4), c] for n, (ms, c) in ks.items()} for p, ks in table.items()}}


def report(a: dict) -> str:
    lines = [f"step wall {a['wall_ms']:.1f} ms under the profiler; GPU busy {a['gpu_busy_ms']:.1f} ms, idle "
             f"{a['gpu_idle_share']:.1%}; {a['kernel_launches']} kernels"]
    phases = [p for p in PHASES if p in a["phase_busy_ms"]]
    lines.append(f"{'family':<22}" + "".join(f"{p[:14]:>15}" for p in phases) + f"{'all':>10}{'share':>8}")
    total = sum(sum(v.values()) for v in a["families_ms"].values())
    for f, by in sorted(a["families_ms"].items(), key=lambda kv: -sum(kv[1].values())):
        s = sum(by.values())
        lines.append(f"{f:<22}" + "".join(f"{by.get(p, 0.0):>15.1f}" for p in phases) + f"{s:>10.1f}{s / total:>8.1%}")
    lines.append(f"{'busy (union)':<22}" + "".join(f"{a['phase_busy_ms'].get(p, 0.0):>15.1f}" for p in phases))
    lines.append(f"{'window (with idle)':<22}" + "".join(f"{a['phase_window_ms'].get(p, 0.0):>15.1f}" for p in phases))
    lines.append("top kernels:")
    for k in a["top_kernels"][:30]:
        lines.append(f"  {k['ms']:>8.2f} ms {k['count']:>5}x  {k['family']:<20} {k['phase']:<18} {k['name'][:90]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default=None, help="27b or large (default: 27b on a GPU, large on a CPU)")
    p.add_argument("--target-layers", type=int, default=None, help="decoder layers of the target (default: the preset's)")
    p.add_argument("--fp8-target", action="store_true", help="quantise the random target to block FP8")
    p.add_argument("--kind", default=DEFAULT, choices=names())
    p.add_argument("--warmup", type=int, default=None, help="steps before the profiled one (default 4 GPU, 1 CPU)")
    p.add_argument("--after", type=int, default=None, help="timed steps after the profiled one (default 4 GPU, 1 CPU)")
    p.add_argument("--pack-tokens", type=int, default=None, help="tokens per row (default 8192 GPU, 512 CPU)")
    p.add_argument("--pack-anchors", type=int, default=None, help="anchors per row (default 1024 GPU, 64 CPU)")
    p.add_argument("--max-length", type=int, default=None, help="longest sequence (default 4096 GPU, 256 CPU)")
    p.add_argument("--sequences", type=int, default=400)
    p.add_argument("--without", default="", help=f"step changes to undo ({', '.join(LEVERS)}): a 'before' profile")
    p.add_argument("--json", help="write the analysis here")
    p.add_argument("--trace", help="also write the profiler's chrome trace here (.json.gz)")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    for key, on_gpu, on_cpu in (("warmup", 4, 1), ("after", 4, 1), ("pack_tokens", 8192, 512),
                                ("pack_anchors", 1024, 64), ("max_length", 4096, 256)):
        if getattr(args, key) is None:
            setattr(args, key, on_gpu if gpu else on_cpu)
    shape = dict(QWEN35_27B if (args.preset or ("27b" if gpu else "large")) == "27b" else
                 scaled_qwen35_shape(256, 4, 4096))
    if args.target_layers:
        shape["layers"] = args.target_layers
    undo_levers([n for n in args.without.split(",") if n])
    target = random_target(shape, device, torch.bfloat16 if gpu else torch.float32)
    if args.fp8_target:
        quantize_model(target.model, default_modules_to_not_convert(target.model))
        use_fp8_gemm(target.model, pick_gemm(device))
        free_memory(device)
    items = items_of(chat_mix(args.sequences, 0, args.max_length), target.vocab_size)
    mark = Markers(device) if gpu else (lambda phase: None)
    if gpu:
        instrument(target, mark)
    from torch.profiler import ProfilerActivity, profile

    prof_at = args.warmup + 1  # the step profiled: the one after `warmup` steps
    total = prof_at + args.after
    stamps, peaks, state = [], [], {}
    result = {"device": torch.cuda.get_device_name(0) if gpu else "cpu", "torch": torch.__version__,
              "target_layers": shape["layers"], "fp8_target": args.fp8_target, "kind": args.kind,
              "without": args.without, "pack_tokens": args.pack_tokens, "pack_anchors": args.pack_anchors, "profiled_step": prof_at}

    def finish() -> None:  # the figures, then out: the trainer's end-of-run checkpoint is not measured
        times = [b - a for a, b in zip([state["start"]] + stamps, stamps)]
        timed = times[1:prof_at - 1] + times[prof_at:]
        result.update({"step_seconds": [round(t, 4) for t in times], "median_step_s": statistics.median(timed),
                       "max_step_s": max(timed), "tokens_per_step": state["tokens"],
                       "peak_memory_gib": max(peaks) if peaks else None})
        if gpu:
            result.update(analyse(state["prof"], mark.opened, state["wall"]))
            print(report(result))
            if args.trace:
                state["prof"].export_chrome_trace(args.trace)
        print(json.dumps({k: v for k, v in result.items() if k not in ("table", "top_kernels", "families_ms")}))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        sys.stdout.flush()
        os._exit(0)

    def on_step(step, m):
        sync(device)
        now = time.perf_counter()
        if len(stamps) == prof_at - 1:  # the profiled step ends
            state["wall"] = now - state["t0"]
            if gpu:
                mark.on = False
            state["prof"].__exit__(None, None, None)
        stamps.append(now)
        peaks.append(m.get("gpu_mem_gib", 0.0))
        state.setdefault("tokens", []).append(m["tokens"])
        if len(stamps) == total:
            finish()
        if len(stamps) == args.warmup:  # the next step is profiled
            state["prof"] = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else []))
            state["prof"].__enter__()
            if gpu:
                mark.on = True
                mark("rest")
            state["t0"] = time.perf_counter()
        return False

    from dflash.train.trainer import train

    with tempfile.TemporaryDirectory(prefix="bench-prof-") as out:
        cfg = TrainConfig.from_flat(out=out, block_size=16, drafter_layers=5, max_length=args.max_length,
                                    max_steps=total + 1, epochs=0, save_every=0, log_every=10**6, progress=False,
                                    device=str(device), memory_check=False, drafter_kind=args.kind, packing="on",
                                    pack_tokens=args.pack_tokens, pack_anchors=args.pack_anchors)
        state["start"] = time.perf_counter()
        train(cfg, target=target, items=items, on_step=on_step, handle_signals=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
