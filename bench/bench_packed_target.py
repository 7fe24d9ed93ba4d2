"""The target's forward over packed rows against the fixed shape, with the full-attention layers' two routes.

    python bench/bench_packed_target.py --json out.json      one GPU, Qwen3.5-27B's shape (fits an 80 GB card)

A random target of the 27B shape (bf16) runs `Target.context`, the tapped states training reads, on:
    fixed           2 x 4096 tokens, no mask: sdpa's flash kernel (is_causal)
    packed-masked   1 x 8192 tokens: the pack of most sequences that training's packer (dflash.data.packs) forms
                    from bench_length_mix's chat-like mix, the full-attention layers on
                    sdpa under the block-diagonal mask transformers builds from the restarting positions
    packed-varlen   the same pack, those layers on flash attention's varlen kernel (dflash.model.packed_attention)
and prints the median forward time of each and the ratios, side by side in one process. The pack's tapped
states of both routes are compared (max |varlen - masked| / max |masked|).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_length_mix import chat_mix  # noqa: E402
from dflash.data.packs import make_packs  # noqa: E402
from dflash.model.packed_attention import ATTENTION  # noqa: E402
from dflash.model.segments import Segments  # noqa: E402
from dflash.model.shapes import QWEN35_27B, random_target  # noqa: E402
from dflash.train.probes.timing import timed  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_packed_target needs a CUDA GPU (flash attention's varlen kernel)")
    device = torch.device("cuda")
    target = random_target(QWEN35_27B, device, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    mix = chat_mix(200, 0, 4096)
    row = [mix[i] for i in max(make_packs(mix, args.tokens, seed=0, epoch=0), key=len)]  # a pack training forms
    segments = Segments.from_lengths([row], args.tokens, device=device)
    packed_ids = torch.randint(4, QWEN35_27B["vocab"] - 1, (1, args.tokens), generator=g).to(device)
    fixed_ids = torch.randint(4, QWEN35_27B["vocab"] - 1, (2, args.tokens // 2), generator=g).to(device)
    print(json.dumps({"pack": row, "real_tokens": sum(row)}), flush=True)

    rows, states = {}, {}
    for name, route, ids, segs in (("fixed", ATTENTION, fixed_ids, None),
                                   ("packed-masked", "sdpa", packed_ids, segments),
                                   ("packed-varlen", ATTENTION, packed_ids, segments)):
        target.model.set_attn_implementation(route)
        torch.cuda.reset_peak_memory_stats()
        ms = timed(lambda: target.context(ids, segments=segs), device, args.reps, args.warmup)
        if segs is not None:
            states[name] = target.context(ids, segments=segs).float()
        rows[name] = {"median_s": ms / 1e3, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
        print(json.dumps({"variant": name, **rows[name]}), flush=True)
    masked = states["packed-masked"]
    rel = float((states["packed-varlen"] - masked).abs().max() / masked.abs().max())
    fixed_s = rows["fixed"]["median_s"]
    print(f"\n{'variant':<14} {'median s':>9} {'vs fixed':>9} {'peak GiB':>9}")
    for name, r in rows.items():
        print(f"{name:<14} {r['median_s']:>9.4f} {r['median_s'] / fixed_s:>8.3f}x {r['peak_gib']:>9.1f}")
    print(f"packed-varlen / packed-masked forward time: {rows['packed-varlen']['median_s'] / rows['packed-masked']['median_s']:.3f}x; "
          f"tapped states max |varlen - masked| / max |masked| = {rel:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"pack": row, "rows": rows, "relative_state_difference": rel}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
