"""Loss benchmark: the full-logits loss vs the chunked and the fused LM head, side by side in one run.

    python bench/bench_loss.py                         (make bench-loss; GPU: a Qwen3-8B-sized head)
    python bench/bench_loss.py --hidden 1024 --vocab 32000 --rows 2048     (a size a CPU can take)

The three paths run forward + backward on the same drafter hidden states and the same frozen LM head:
  full     dflash_loss(head(hidden), ...): [anchors x block, vocab] logits, then the cross-entropy
  chunked  dflash_loss_from_hidden(hidden, head, ...): the head on scored rows only, --chunk rows at a
           time under activation checkpointing (the logits recomputed in the backward)
  fused    dflash.objective.head_loss.fused_weighted_ce: the same rows and chunks, the rows' gradient computed in
           the forward (two products a chunk, no recomputation): what the training step runs
It prints the median step time and, on a GPU, the peak memory above the inputs, with the ratios, and
checks that the three losses agree.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from dflash.objective.head_loss import fused_weighted_ce
from dflash.objective.losses import LOSS_CHUNK_ROWS, dflash_loss, dflash_loss_from_hidden


def measure(fn, device: torch.device, reps: int) -> tuple[float, float, float]:
    """(median seconds, peak bytes above the starting allocation, loss) of fn() + backward."""
    times, peak, loss_value = [], 0.0, 0.0
    for rep in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        loss = fn()
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
        if rep:  # the first repetition warms up kernels and the allocator
            times.append(time.perf_counter() - t0)
        loss_value = loss.item()
    return statistics.median(times), peak, loss_value


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096, help="hidden size (Qwen3-8B: 4096)")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary (Qwen3: 151936)")
    p.add_argument("--anchors", type=int, default=512, help="anchors per micro-batch")
    p.add_argument("--block-size", type=int, default=16, help="block size")
    p.add_argument("--rows", type=int, default=None, help="override anchors x block size (rows of hidden states)")
    p.add_argument("--chunk", type=int, default=LOSS_CHUNK_ROWS, help="rows per LM-head chunk")
    p.add_argument("--valid", type=float, default=0.9, help="share of labels that are supervised")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (after one warm-up)")
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bs = args.block_size
    anchors = (args.rows // bs) if args.rows else args.anchors
    g = torch.Generator(device="cpu").manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False).to(device, dtype).requires_grad_(False)
    hidden = (torch.randn(1, anchors, bs, args.hidden, generator=g) * 0.5).to(device, dtype).requires_grad_(True)
    labels = torch.randint(0, args.vocab, (1, anchors, bs - 1), generator=g).to(device)
    valid = (torch.rand(1, anchors, bs - 1, generator=g) < args.valid).to(device)

    def full():
        hidden.grad = None
        return dflash_loss(head(hidden), labels, valid)[0]

    def chunked():
        hidden.grad = None
        return dflash_loss_from_hidden(hidden, head, labels, valid, chunk_rows=args.chunk)[0]

    def fused():
        hidden.grad = None
        total, weight, _ = fused_weighted_ce(hidden, head.weight, labels, valid, chunk_rows=args.chunk)
        return total / weight

    rows = anchors * bs
    print(f"loss benchmark on {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'} ({dtype}): "
          f"{rows} rows ({anchors} anchors x block {bs}, {args.valid:.0%} supervised), hidden {args.hidden}, "
          f"vocab {args.vocab}, chunk {args.chunk}")
    t_full, m_full, l_full = measure(full, device, args.reps)
    t_chunk, m_chunk, l_chunk = measure(chunked, device, args.reps)
    t_fused, m_fused, l_fused = measure(fused, device, args.reps)
    print(f"  {'path':<9} {'step ms':>9} {'peak MB':>9}")
    for name, t, m in (("full", t_full, m_full), ("chunked", t_chunk, m_chunk), ("fused", t_fused, m_fused)):
        print(f"  {name:<9} {t * 1e3:9.1f} {m / 2**20 if device.type == 'cuda' else float('nan'):9.0f}")
    for name, t, m, l in (("chunked", t_chunk, m_chunk, l_chunk), ("fused", t_fused, m_fused, l_fused)):
        ratio_mem = f", peak memory {m / m_full:.2f}x" if device.type == "cuda" and m_full else ""
        print(f"  {name}/full: time {t / t_full:.2f}x{ratio_mem}; losses {l_full:.5f} vs {l:.5f}")
    if max(abs(l_full - l_chunk), abs(l_full - l_fused)) > 1e-2 * max(1.0, abs(l_full)):
        print("  the losses disagree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
