"""How large a micro-batch fits on one GPU beside the frozen target: anchors x sequence length, before and after.

    python bench/bench_fit.py                       the 27B-shape random target (54 GB in bf16), one H200
    python bench/bench_fit.py --preset large --seq-lens 1024,2048 --anchors 64,128   (smaller, for a try)

For each variant (bench_train's: before = eager drafter layers and the checkpointed LM head chunks, after =
compiled layers and the fused head: dflash.train.step's fused_head), each sequence length of --seq-lens and each anchor count of
--anchors in increasing order, one full training micro-batch runs on --batch-size sequences: the
target's forward, the drafter's forward and loss, the backward, the AdamW step (its state allocated
beforehand, as in training). A size that runs out of memory ends that sequence length (larger anchor
counts need more). Reported: the largest anchor count that ran per sequence length, the peak memory of
each try (torch.cuda.max_memory_allocated) and the card's memory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dflash import distributed
from dflash.model.drafter import Drafter, DrafterConfig
from dflash.model.shapes import QWEN35_27B, random_target, scaled_qwen35_shape
from dflash.train.step import backward, micro_batch_sums
from dflash.train.probes.synthetic import collate_with_anchors, synthetic_items
from dflash.train.probes.timing import free_memory


def one_micro_batch(drafter, opt, target, items, max_anchors: int, device, fused_head: bool) -> int:
    """Forward, backward and AdamW step of one micro-batch; returns the anchors it held."""
    d = distributed.Dist(rank=0, world_size=1, local_rank=0, device=device)
    batch, anchors = collate_with_anchors(items, max_anchors, device)
    sums = micro_batch_sums(drafter, target, batch, anchors, block_size=drafter.config.block_size, gamma=None,
                            autocast_dtype=torch.bfloat16, fused_head=fused_head)
    backward(sums, d, grad_accum=1)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return sum(int(a.numel()) for a in anchors)


def fit(variant: str, target, args, device) -> list[dict]:
    torch.manual_seed(0)
    dcfg = DrafterConfig.from_target(target, num_hidden_layers=5, block_size=16)
    with torch.device(device):
        drafter = Drafter(dcfg, attention="flex")
    if variant == "after":
        drafter.compile_layers()
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=True)
    fused_head = variant != "before"  # before: the LM head in checkpointed chunks
    seqs = [int(x) for x in args.seq_lens.split(",")]
    counts = [int(x) for x in args.anchors.split(",")]
    one_micro_batch(drafter, opt, target, synthetic_items(args.batch_size, min(seqs), target.vocab_size),
                    min(counts), device, fused_head)  # AdamW state allocated before anything is measured
    rows = []
    for seq in seqs:
        items = synthetic_items(args.batch_size, seq, target.vocab_size)
        for n in counts:
            if n > seq // 2 - 1:  # no more anchor positions in the supervised half
                break
            torch.cuda.reset_peak_memory_stats(device)
            row = {"variant": variant, "seq_len": seq, "batch_size": args.batch_size, "anchors_per_seq": n}
            try:
                row["anchors"] = one_micro_batch(drafter, opt, target, items, n, device, fused_head)
                row["peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
                row["fits"] = True
            except torch.OutOfMemoryError:
                row["fits"] = False
                opt.zero_grad(set_to_none=True)
            free_memory(device)
            print(json.dumps(row), flush=True)
            rows.append(row)
            if not row["fits"]:
                break
    del drafter, opt
    free_memory(device)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default="27b", choices=("27b", "large"))
    p.add_argument("--variants", default="before,after")
    p.add_argument("--seq-lens", default="4096,8192,16384", help="comma list of tokens per sequence")
    p.add_argument("--anchors", default="512,1024,2048,4096", help="comma list of anchors per sequence, increasing")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2048, help="large preset: width")
    p.add_argument("--layers", type=int, default=16, help="large preset: layers")
    p.add_argument("--vocab", type=int, default=151936, help="large preset: vocabulary")
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU: what fits is a question about GPU memory")
    device = torch.device("cuda")
    shape = QWEN35_27B if args.preset == "27b" else scaled_qwen35_shape(args.hidden, args.layers, args.vocab)
    target = random_target(shape, device, torch.bfloat16)
    total = torch.cuda.get_device_properties(device).total_memory / 1e9
    weights = sum(t.numel() * t.element_size() for t in target.model.parameters()) / 1e9
    rows = []
    for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
        rows += fit(variant, target, args, device)
    print(f"\ncard {total:.0f} GB, target weights {weights:.1f} GB, {args.batch_size} sequences per micro-batch")
    print(f"{'variant':<8} {'seq len':>8} {'largest anchors/seq that fits':>30} {'peak GB':>8}")
    for variant in dict.fromkeys(r["variant"] for r in rows):
        for seq in dict.fromkeys(r["seq_len"] for r in rows if r["variant"] == variant):
            ok = [r for r in rows if r["variant"] == variant and r["seq_len"] == seq and r["fits"]]
            best = max(ok, key=lambda r: r["anchors_per_seq"]) if ok else None
            print(f"{variant:<8} {seq:>8} {best['anchors_per_seq'] if best else 'none':>30} "
                  f"{best['peak_gb'] if best else float('nan'):>8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"card_gb": total, "target_weights_gb": weights, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
