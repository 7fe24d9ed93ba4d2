"""flex_attention's backward kernel configurations at the drafter's attention shape, side by side.

    python bench/bench_flex.py                      27B shape (q [2,24,16384,256], k/v [2,4,24576,256])
    python bench/bench_flex.py --shape small

The drafter's attention (dflash.model.drafter, flex path) at a real shape: queries are the block rows, keys the
context + block rows, the BlockMask is the drafter's (dflash.model.masks) for anchors sampled as the
trainer samples them (dflash.train.probes.synthetic; shapes: dflash.model.shapes.STEP_SHAPES). For each configuration of the backward kernel (tile sizes BLOCK_M1/N1 for dK/dV, M2/N2 for
dQ, pipeline stages, warps; torch's default for the device first), flex_attention is compiled with those
kernel options and timed: median ms of forward, and of forward + backward, with CUDA events. Every
configuration's output and gradients are compared with the default's (max |diff| / max |ref|), so a
faster one that computes something else is caught. dflash.model.drafter.FLEX_BACKWARD_TILES holds the winner.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dflash.model.drafter import flex_block_mask
from dflash.model.masks import drafter_attention_mask
from dflash.train.blocks import build_blocks
from dflash.model.shapes import STEP_SHAPES
from dflash.train.probes.synthetic import synthetic_batch
from dflash.train.probes.timing import timed

# (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_stages, num_warps); None = torch's default for the device
CONFIGS = [None, (64, 64, 64, 64, 2, 8), (64, 64, 64, 64, 3, 4), (32, 64, 64, 32, 3, 4), (32, 128, 128, 32, 2, 8),
           (64, 128, 128, 64, 2, 8)]


def options(config) -> dict:
    if config is None:
        return {}
    m1, n1, m2, n2, stages, warps = config
    return {"bwd_BLOCK_M1": m1, "bwd_BLOCK_N1": n1, "bwd_BLOCK_M2": m2, "bwd_BLOCK_N2": n2,
            "bwd_num_stages": stages, "bwd_num_warps": warps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="27b", choices=sorted(STEP_SHAPES))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.cache_size_limit = 64  # one compiled variant per configuration
    device = torch.device("cuda")
    s = STEP_SHAPES[args.shape]
    batch, anchors = synthetic_batch(s, device)
    blocks = build_blocks(batch["input_ids"], batch["loss_mask"], anchors, 16, s["vocab"] - 1)
    B, N = blocks.anchors.shape
    T, Q = s["seq"], N * 16
    mask = flex_block_mask(drafter_attention_mask(blocks.anchors, T, 16, batch["attention_mask"].bool(),
                                                  blocks.anchor_valid))
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, s["heads"], Q, s["head_dim"], generator=g, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(B, s["kv_heads"], T + Q, s["head_dim"], generator=g, device=device, dtype=torch.bfloat16)
            for _ in range(2))
    dout = torch.randn_like(q)
    rows, ref = [], None
    for config in CONFIGS:
        fn = torch.compile(flex_attention, dynamic=False)
        kw = dict(block_mask=mask, enable_gqa=True, kernel_options=options(config))
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def forward():
            with torch.no_grad():
                fn(*leaves, **kw)

        def both():
            out = fn(*leaves, **kw)
            out.backward(dout)

        try:
            out = fn(*leaves, **kw)
            out.backward(dout)
            result = [out.detach()] + [t.grad.detach().clone() for t in leaves]
            for t in leaves:
                t.grad = None
            fwd_ms = timed(forward, device, args.reps, warmup=2)
            both_ms = timed(both, device, args.reps, warmup=1)
        except Exception as exc:  # a configuration the kernel cannot take (shared memory, static asserts)
            row = {"config": config, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
            print(json.dumps(row), flush=True)
            rows.append(row)
            continue
        if ref is None:
            ref = result
        err = max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(result, ref))
        row = {"config": config or "default", "forward_ms": fwd_ms, "backward_ms": both_ms - fwd_ms,
               "fwd_bwd_ms": both_ms, "max_rel_diff_vs_default": err}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del result
    ok = [r for r in rows if "error" not in r]
    base = next((r for r in ok if r["config"] == "default"), None)
    print(f"\n{'config (M1,N1,M2,N2,stages,warps)':<36} {'fwd ms':>8} {'bwd ms':>8} {'vs default':>10} {'max rel diff':>12}")
    for r in ok:
        speed = f"{base['backward_ms'] / r['backward_ms']:.2f}x" if base else "-"
        print(f"{str(r['config']):<36} {r['forward_ms']:>8.2f} {r['backward_ms']:>8.2f} {speed:>10} "
              f"{r['max_rel_diff_vs_default']:>12.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
