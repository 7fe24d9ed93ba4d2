"""FP8 target against bf16, in one run: target forward time, whole-loop tokens/s, target memory, the tapped
states' divergence per tapped layer, and whether --layout replicate fits a capped card with the FP8 target.

    python bench/bench_fp8.py --json fp8.json                     one H200: the 27B shape, 2 x 4096, 512 anchors
    python bench/bench_fp8.py --cap-gb 102 --json fp8-cap.json    the same loop under a 102 GB cap (a 96 GB card)
    python bench/bench_fp8.py --device cpu --shape toy            toy size on a CPU (tests/bench runs this)

The FP8 target is the bf16 random target quantised in memory with the checkpoint writer's own code
(dflash.model.fp8.quantize_model with Qwen's modules_to_not_convert, 128 x 128 blocks), so both targets are
the same model; its linear layers run on each --gemms GEMM in turn (default: the one pick_gemm chooses): the
target forward and the divergence for each, the whole loop for the first (the one training would use).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from dflash.model.fp8 import pick_gemm, quantize_model, use_fp8_gemm, weight_bytes
from dflash.model.fp8_checkpoint import default_modules_to_not_convert
from dflash.model.shapes import QWEN35_27B, random_target, scaled_qwen35_shape
from dflash.train.probes.timing import free_memory, sync, timed

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import bench_train  # noqa: E402  the loop and its config, as bench_train runs them

SHAPES = {"27b": QWEN35_27B, "toy": scaled_qwen35_shape(128, 4, 512)}


def forward_seconds(target, ids, reps: int, whole: bool = False) -> float:
    """Seconds per target.context (training's pass, which ends after the last tapped layer), or with `whole`
    per pass through every layer and the final norm (forward_cached without a cache)."""
    run = target.forward_cached if whole else target.context
    run(ids)
    sync(target.device)
    start = time.perf_counter()
    for _ in range(reps):
        run(ids)
    sync(target.device)
    return (time.perf_counter() - start) / reps


def linear_breakdown(model, tokens: int, device, reps: int) -> list[dict]:
    """Each distinct FP8 linear shape [N, K] of `model` at `tokens` rows, in milliseconds: the bf16 F.linear
    it replaces, the whole FP8 layer (activation quantisation + GEMM), its quantisation alone (the one-pass
    kernel the GEMMs use) and the eager reference quantisation; `count` layers of that shape."""
    from dflash.model.fp8 import Fp8Linear
    from dflash.model.fp8 import quantize_activation as eager_quantize
    from dflash.model.fp8_triton import quantize_activation as kernel_quantize

    shapes: dict[tuple[int, int], list[Fp8Linear]] = {}
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            shapes.setdefault((module.out_features, module.in_features), []).append(module)
    rows = []
    for (n, k), layers in sorted(shapes.items()):
        x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        row = {"n": n, "k": k, "count": len(layers), "gemm": layers[0].gemm,
               "bf16_ms": timed(lambda: torch.nn.functional.linear(x, w), device, reps),
               "fp8_ms": timed(lambda: layers[0](x), device, reps),
               "quantize_ms": timed(lambda: kernel_quantize(x), device, reps),
               "eager_quantize_ms": timed(lambda: eager_quantize(x), device, reps)}
        rows.append({key: round(v, 4) if isinstance(v, float) else v for key, v in row.items()})
    return rows


def print_breakdown(rows: list[dict]) -> None:
    print(f"{'[N, K]':>14} {'layers':>6} {'gemm':>9} {'bf16 ms':>8} {'fp8 ms':>8} {'quant ms':>8} {'eager q ms':>10}")
    for r in rows:
        print(f"{str([r['n'], r['k']]):>14} {r['count']:>6} {r['gemm']:>9} {r['bf16_ms']:>8.3f} {r['fp8_ms']:>8.3f} "
              f"{r['quantize_ms']:>8.3f} {r['eager_quantize_ms']:>10.3f}")
    total = {key: sum(r[key] * r["count"] for r in rows) for key in ("bf16_ms", "fp8_ms", "quantize_ms", "eager_quantize_ms")}
    print(f"all FP8 linear layers of one forward: bf16 {total['bf16_ms']:.0f} ms, FP8 {total['fp8_ms']:.0f} ms "
          f"({total['bf16_ms'] / total['fp8_ms']:.2f}x), of which quantisation {total['quantize_ms']:.0f} ms "
          f"(eager torch would take {total['eager_quantize_ms']:.0f} ms)")


def loop(target, args, device, label: str) -> dict:
    if args.forward_only:
        return {}
    try:
        row = bench_train.bench_one(label, target, args, device, "auto", "after", None)
        return {"tokens_per_s": row["loop"]["tokens_per_s"], "ok": True}
    except torch.OutOfMemoryError as exc:
        free_memory(device)
        return {"ok": False, "error": str(exc).splitlines()[0]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=SHAPES, default="27b")
    p.add_argument("--gemms", default="", help="comma-separated FP8 GEMMs to time, the loop's first (default: pick_gemm's)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="target forwards timed")
    p.add_argument("--forward-only", action="store_true",
                   help="time the target forwards and the divergence, no training loop (a card too small for one)")
    p.add_argument("--cap-gb", type=float, default=0.0, help="cap this process's GPU memory (replicate check)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.shape == "toy":
        args.seq_len, args.anchors, args.drafter_layers = min(args.seq_len, 128), min(args.anchors, 8), 1
    if args.cap_gb and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gb * 1e9 / total), device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SHAPES[args.shape]
    args.no_split = True  # bench_train's phase split is bench_train's to report
    ids = torch.randint(3, shape["vocab"], (args.batch_size, args.seq_len),
                        generator=torch.Generator().manual_seed(0)).to(device)
    result = {"shape": args.shape, "device": str(device), "cap_gb": args.cap_gb, "micro_batch":
              [args.batch_size, args.seq_len, args.anchors], "bf16": {}, "fp8": {}}

    target = random_target(shape, device, dtype)
    bf16 = result["bf16"]
    bf16["weight_gb"] = weight_bytes(target.model) / 1e9
    bf16["forward_s"] = forward_seconds(target, ids, args.reps)
    bf16["whole_decoder_s"] = forward_seconds(target, ids, args.reps, whole=True)
    print(f"bf16 target: context() ending after tapped layer {max(target.layer_ids)} of {target.num_layers} "
          f"{bf16['forward_s']:.3f} s vs the whole decoder {bf16['whole_decoder_s']:.3f} s "
          f"({bf16['whole_decoder_s'] / bf16['forward_s']:.3f}x)", flush=True)
    reference = target.context(ids).float().cpu()
    bf16.update(loop(target, args, device, "bf16"))
    print(json.dumps({"bf16": bf16}), flush=True)

    quantize_model(target.model, default_modules_to_not_convert(target.model))
    free_memory(device)
    fp8_gb = weight_bytes(target.model) / 1e9
    gemms = [g for g in args.gemms.split(",") if g] or [pick_gemm(device)]
    for gemm in gemms:
        use_fp8_gemm(target.model, gemm)
        try:  # one GEMM that fails (a kernel this torch lacks) must not lose the others' figures
            row = {"weight_gb": fp8_gb, "forward_s": forward_seconds(target, ids, args.reps)}
        except Exception as exc:
            result["fp8"][gemm] = {"error": f"{type(exc).__name__}: {str(exc)[:1000]}"}
            print(json.dumps({"fp8": {gemm: result["fp8"][gemm]}}), flush=True)
            free_memory(device)
            continue
        states = target.context(ids).float().cpu()
        H = target.hidden_size
        row["tapped_rel_l2"] = {layer: round(((reference[..., i * H:(i + 1) * H] - states[..., i * H:(i + 1) * H]).norm()
                                              / reference[..., i * H:(i + 1) * H].norm()).item(), 5)
                                for i, layer in enumerate(target.layer_ids)}
        if device.type == "cuda" and gemm != "dequant":
            row["linear_breakdown"] = linear_breakdown(target.model, args.batch_size * args.seq_len, device, args.reps)
            print_breakdown(row["linear_breakdown"])
        if gemm == gemms[0]:
            row.update(loop(target, args, device, f"fp8-{gemm}"))
        result["fp8"][gemm] = row
        print(json.dumps({"fp8": {gemm: row}}), flush=True)
        ratios = {"forward_speedup": bf16["forward_s"] / row["forward_s"], "memory_ratio": fp8_gb / bf16["weight_gb"]}
        if bf16.get("ok") and row.get("ok"):
            ratios["loop_speedup"] = row["tokens_per_s"] / bf16["tokens_per_s"]
        row["ratios_vs_bf16"] = {k: round(v, 3) for k, v in ratios.items()}
        print(f"FP8 ({gemm}) vs bf16: target forward {row['forward_s']:.3f} s vs {bf16['forward_s']:.3f} s "
              f"({ratios['forward_speedup']:.2f}x); target weights {fp8_gb:.1f} GB vs {bf16['weight_gb']:.1f} GB "
              f"({ratios['memory_ratio']:.2f}x); whole loop "
              + (f"{row['tokens_per_s']:,.0f} vs {bf16['tokens_per_s']:,.0f} tokens/s ({ratios['loop_speedup']:.2f}x)"
                 if "loop_speedup" in ratios else "not run" if "ok" not in row else
                 f"bf16 {'ran' if bf16.get('ok') else 'ran out of memory'}, "
                 f"FP8 {'ran' if row.get('ok') else 'ran out of memory'}")
              + (f" under a {args.cap_gb:g} GB cap (--layout replicate)" if args.cap_gb else ""))
        print("tapped-state divergence (relative L2) per tapped layer: "
              + ", ".join(f"{k}: {v:.4f}" for k, v in row["tapped_rel_l2"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
