"""Cost of one training micro-batch step, DFlash against DFlash2, side by side on the same target and batch.

    python bench/bench_dflash2.py                          (the cached demo target, CPU)
    python bench/bench_dflash2.py --device cuda --reps 20

Both drafters have the trainer's shape for the demo (--layers, --block-size), the same initial weights
where they share tensors, and run the trainer's own step (dflash.train.step: micro_batch_sums, backward)
on the same synthetic batch; the two are timed alternately, --reps times each after --warmup, and the
medians are compared. DFlash2 runs both published selector objectives ("drop": NeMo Automodel's, the
default; "inject": speculators'), which cost the same up to the injected candidate.

Prediction, written before the first run: DFlash2's step costs 1.3x-1.6x DFlash's on the CPU demo target.
Its extra work is four grouped convolutions and two kernel projections per layer (small beside the
attention and MLP), the selector's K x r scores per scored row, and, dominant, its loss taking the
unfused path: the full-vocabulary logits of the scored rows are computed in the forward and again in the
backward (checkpointed chunks), where DFlash's fused head loss computes them once.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=5, help="drafter layers")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    p.add_argument("--anchors", type=int, default=32, help="anchors per sequence")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)

    from dflash import distributed
    from dflash.demo.tiny_target import build_demo_target
    from dflash.kinds import KINDS, build_drafter
    from dflash.model.target import Target
    from dflash.train.step import backward, micro_batch_sums
    from dflash.train.probes.synthetic import synthetic_batch

    torch.set_num_threads(1)
    device = torch.device(args.device)
    target = Target.load(build_demo_target(progress=False), device=device, dtype=torch.float32)
    shape = dict(num_hidden_layers=args.layers, block_size=args.block_size)
    configs = {"dflash": KINDS["dflash"].config_class.from_target(target, **shape),
               "dflash2 (drop)": KINDS["dflash2"].config_class.from_target(target, **shape)}
    configs["dflash2 (inject)"] = configs["dflash2 (drop)"]
    torch.manual_seed(0)
    drafters = {name: build_drafter(c).to(device) for name, c in configs.items()}
    for d in drafters.values():  # the same weights where the tensors are shared
        d.load_state_dict(drafters["dflash"].state_dict(), strict=False)
    batch, anchors = synthetic_batch(dict(batch=args.batch, seq=args.seq, vocab=target.vocab_size,
                                          anchors=args.anchors), device)
    dist = distributed.Dist(rank=0, world_size=1, local_rank=0, device=device)  # one process: no all-reduce

    def step(name):
        drafter = drafters[name]
        drafter.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        sums = micro_batch_sums(drafter, target, batch, anchors, block_size=args.block_size, gamma=None,
                                autocast_dtype=torch.float32,
                                objective_options={"selector_missing": "inject" if "inject" in name else "drop"})
        backward(sums, dist, 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, sums

    times = {name: [] for name in drafters}
    for rep in range(args.warmup + args.reps):
        for name in drafters:
            seconds, sums = step(name)
            if rep >= args.warmup:
                times[name].append(seconds)
    base = statistics.median(times["dflash"])
    print(f"demo target (hidden {target.hidden_size}, vocab {target.vocab_size}), {args.layers} drafter layers, "
          f"block {args.block_size}, {args.batch} x {args.seq} tokens, <= {args.anchors} anchors per sequence, "
          f"{device.type}; median of {args.reps}")
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"  {name:18s} {median * 1000:8.1f} ms per micro-batch step   {median / base:5.2f}x DFlash")
    return 0


if __name__ == "__main__":
    sys.exit(main())
