"""The memory model of dflash.plan against measured peaks: calibrate on some shapes, predict others, measure.

    python bench/bench_plan.py --json OUT.json        one GPU, about 5 minutes on an H200

1. Calibration: a random target of the 27B width and vocabulary with --calib-layers decoder layers, and
   drafters of 2, 3 and 5 layers; for each calibration micro-batch one warm-up step (compiles, allocates
   AdamW's state), then one measured step whose peak is read per moment (target forward, drafter forward
   and head, backward, optimizer step). The activation coefficients of dflash.plan.memory are fitted
   (non-negative least squares) to the moments' peaks above the static bytes.
2. Validation: the full 27B-shape target (64 layers, 53.8 GB) and the 5-layer drafter at --validate
   micro-batches. For each, the model's prediction is printed first (with the coefficients the code
   ships and with the ones just fitted), then the step runs and its torch.cuda.max_memory_allocated
   and max_memory_reserved are printed beside it, with the ratios.
The static terms (target and drafter weights, AdamW state) are checked exactly against
torch.cuda.memory_allocated before each step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dflash import distributed
from dflash.model.drafter import Drafter, DrafterConfig
from dflash.plan.memory import COEFFS, GB, MicroBatch, activation_terms
from dflash.plan.sizes import drafter_shape, preset_shape
from dflash.model.shapes import QWEN35_27B, random_target
from dflash.train.step import backward, micro_batch_sums
from dflash.train.probes.synthetic import collate_with_anchors, synthetic_items
from dflash.train.probes.timing import free_memory

FEATURES = ("layer", "ctx", "mask", "logit", "param")


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    """'B:T:N:L,...' -> [(B, T, N, L)]."""
    return [tuple(int(x) for x in part.split(":")) for part in text.split(",") if part.strip()]


def features(tshape, dshape, B: int, T: int, N: int) -> dict[str, float]:
    """The drafter phase's features (bytes per coefficient unit), as dflash.plan.memory.activation_terms
    weighs them."""
    ones = {k: 0.0 for k in COEFFS}
    out = {}
    for name in FEATURES:
        probe = dict(ones, **{name: 1.0})
        terms = activation_terms(tshape, dshape, MicroBatch(B, T, N), "bf16", probe)
        out[name] = (terms["drafter_activations"] + terms["weights_in_flight"]) * GB
    return out


def measure(target, L: int, B: int, T: int, N: int, device, cache: dict) -> dict:
    """One warm-up and one measured training micro-batch; the peaks of each moment (bytes)."""
    if cache.get("L") != L:
        cache.clear()
        free_memory(device)
        torch.manual_seed(0)
        dcfg = DrafterConfig.from_target(target, num_hidden_layers=L, block_size=16)
        with torch.device(device):
            drafter = Drafter(dcfg, attention="flex")
        drafter.compile_layers()
        cache.update(L=L, drafter=drafter, opt=torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=True))
    drafter, opt = cache["drafter"], cache["opt"]
    d = distributed.Dist(rank=0, world_size=1, local_rank=0, device=device)
    items = synthetic_items(B, T, target.vocab_size)
    peaks = {}

    def step(record: bool):
        batch, anchors = collate_with_anchors(items, N, device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)

        def mark(phase):
            torch.cuda.synchronize(device)
            if record:
                peaks[phase] = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)

        sums = micro_batch_sums(drafter, target, batch, anchors, block_size=16, gamma=None,
                                autocast_dtype=torch.bfloat16, fused_head=True, mark=mark)
        backward(sums, d, grad_accum=1)
        mark("backward")
        opt.step()
        mark("optimizer step")
        opt.zero_grad(set_to_none=True)
        del sums

    step(False)
    free_memory(device)
    torch.cuda.reset_peak_memory_stats(device)
    static = torch.cuda.memory_allocated(device)
    step(True)
    reserved = torch.cuda.max_memory_reserved(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"static": static, "peaks": peaks, "peak": max(peaks.values()), "reserved": reserved,
            "device_used": total - free}


def nnls(rows: list[list[float]], y: list[float]) -> list[float]:
    """Non-negative least squares by active set (few unknowns): drop the most negative, refit."""
    A, b = torch.tensor(rows, dtype=torch.float64), torch.tensor(y, dtype=torch.float64).unsqueeze(-1)
    scale = A.abs().amax(dim=0).clamp(min=1e-30)
    active = list(range(A.shape[1]))
    while True:
        x = torch.zeros(A.shape[1], dtype=torch.float64)
        if active:
            sol = torch.linalg.lstsq(A[:, active] / scale[active], b).solution.squeeze(-1)
            x[active] = sol / scale[active]
        neg = [i for i in active if x[i] < 0]
        if not neg:
            return x.tolist()
        active.remove(min(neg, key=lambda i: float(x[i])))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calib-layers", type=int, default=8, help="decoder layers of the calibration target (>= 8 "
                   "taps 5 layers as the full target does)")
    p.add_argument("--calibrate", default="2:4096:512:5,1:4096:1024:5,2:2048:256:5,1:2048:128:5,1:8192:256:2,"
                   "2:8192:512:2", help="B:T:anchors:drafter_layers,...")
    p.add_argument("--validate", default="1:4096:512:5,2:4096:256:5,2:2048:512:5,2:4096:512:5,1:8192:512:3",
                   help="B:T:anchors:drafter_layers,... on the full 27B-shape target")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU: the model is checked against the GPU's allocator")
    device = torch.device("cuda")
    # A drafter per layer count, shapes that vary: more specializations than dynamo's default limit of 8,
    # past which it would run the layers eagerly (and keep an eager layer's activations).
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    # Static kernels for every shape, as a run's first shape gets: the dynamic-shape recompile of the
    # drafter layer's backward failed in inductor on the H200 (torch 2.11: "shape '[2048, 256]' is invalid
    # for input of size 1024", bench/results/h200/plan-validation-run2-dynamic-shape-crash.log).
    torch._dynamo.config.automatic_dynamic_shapes = False
    out = {"shipped_coeffs": COEFFS, "calibration": [], "validation": []}
    start = time.time()

    def save():
        if args.json:
            tmp = Path(args.json + ".tmp")
            tmp.write_text(json.dumps(out, indent=2) + "\n")
            tmp.replace(args.json)

    # 1. calibration on a shallow target of the real width (--calibrate '': none, validate the shipped model)
    calibrate = parse_shapes(args.calibrate)
    tshape = preset_shape("27b", layers=args.calib_layers)
    target = random_target(dict(QWEN35_27B, layers=args.calib_layers), device, torch.bfloat16) if calibrate else None
    cache: dict = {}
    rows, y_drafter, tgt = [], [], []
    for B, T, N, L in calibrate:
        dshape = drafter_shape(tshape, layers=L)
        m = measure(target, L, B, T, N, device, cache)
        static_pred = tshape.params * 2 + 12 * dshape.params  # weights, fp32 drafter + AdamW (no gradients yet)
        f = features(tshape, dshape, B, T, N)
        drafter_peak = max(m["peaks"]["drafter forward"], m["peaks"]["backward"])
        rows.append([f[k] for k in FEATURES])
        y_drafter.append(drafter_peak - m["static"])
        tgt.append((m["peaks"]["target forward"] - m["static"]) / (B * T * tshape.hidden))
        rec = {"shape": [B, T, N, L], **m, "static_predicted": static_pred}
        out["calibration"].append(rec)
        print(f"calib B={B} T={T} N={N} L={L}: static {m['static'] / GB:.2f} GB (model {static_pred / GB:.2f}), "
              f"peaks " + ", ".join(f"{k} {v / GB:.2f}" for k, v in m["peaks"].items())
              + f", reserved {m['reserved'] / GB:.2f}, device {m['device_used'] / GB:.2f}  [{time.time() - start:.0f} s]",
              flush=True)
        save()
    fitted = None
    if rows:
        fitted = dict(zip(FEATURES, nnls(rows, y_drafter)))
        fitted["target"] = max(tgt)
        out["fitted_coeffs"] = fitted
        print("fitted coefficients:", json.dumps({k: round(v, 3) for k, v in fitted.items()}), flush=True)
        for rec, row, yv in zip(out["calibration"], rows, y_drafter):
            fit = sum(fitted[k] * x for k, x in zip(FEATURES, row))
            rec["drafter_extra"], rec["drafter_extra_fit"] = yv, fit
        save()
    del target, cache
    free_memory(device)

    # 2. validation on the full 27B-shape target
    tshape = preset_shape("27b")
    target = random_target(QWEN35_27B, device, torch.bfloat16)
    cache = {}
    from dflash.plan.memory import rank_peaks

    for B, T, N, L in parse_shapes(args.validate):
        dshape = drafter_shape(tshape, layers=L)
        mb = MicroBatch(B, T, N)
        pred = {name: rank_peaks(tshape, dshape, mb, "replicate", 1, "bf16", coeffs=co)[0]
                for name, co in (("shipped", None), ("fitted", fitted)) if name == "shipped" or fitted}
        for name, pk in pred.items():
            alloc = pk.total_gb - pk.terms["cuda_context"] - pk.terms["allocator"]
            print(f"predict B={B} T={T} N={N} L={L} ({name} coefficients): allocated {alloc:.2f} GB, with "
                  f"context and allocator {pk.total_gb:.2f} GB, at the {pk.moment}", flush=True)
        try:
            m = measure(target, L, B, T, N, device, cache)
        except torch.OutOfMemoryError:
            m = None
        rec = {"shape": [B, T, N, L], "predicted": {k: v.to_dict() for k, v in pred.items()}, "measured": m}
        out["validation"].append(rec)
        if m:
            for name, pk in pred.items():
                alloc = pk.total_gb - pk.terms["cuda_context"] - pk.terms["allocator"]
                rec[f"ratio_allocated_{name}"] = alloc / (m["peak"] / GB)
                rec[f"ratio_device_{name}"] = pk.total_gb / (m["device_used"] / GB)
            ratios = ", ".join(f"{name}: allocated {rec[f'ratio_allocated_{name}']:.3f}, device "
                               f"{rec[f'ratio_device_{name}']:.3f}" for name in pred)
            print(f"measured B={B} T={T} N={N} L={L}: peak allocated {m['peak'] / GB:.2f} GB, reserved "
                  f"{m['reserved'] / GB:.2f}, device used {m['device_used'] / GB:.2f}; predicted/measured "
                  f"({ratios})  [{time.time() - start:.0f} s]", flush=True)
        else:
            print(f"measured B={B} T={T} N={N} L={L}: out of memory", flush=True)
        save()
    print("\nmicro-batch (B x T, anchors/seq, drafter layers)  coefficients  predicted GB  measured GB  ratio"
          "  (allocated; device: with CUDA context and allocator)")
    for rec in out["validation"]:
        B, T, N, L = rec["shape"]
        if rec["measured"]:
            for name, pk in rec["predicted"].items():
                alloc = pk["peak_gb"] - pk["terms_gb"]["cuda_context"] - pk["terms_gb"]["allocator"]
                print(f"{B} x {T}, {N}, {L}{'':>27} {name:<12} {alloc:>12.2f} {rec['measured']['peak'] / GB:>12.2f} "
                      f"{rec[f'ratio_allocated_{name}']:>6.3f}   device {pk['peak_gb']:.2f} / "
                      f"{rec['measured']['device_used'] / GB:.2f} = {rec[f'ratio_device_{name}']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
