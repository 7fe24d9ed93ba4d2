"""The whole training loop with an FP8 target against the same loop with the bf16 target, one after the other
on one card: packed rows of the chat-like mix (bench/bench_length_mix.py's packed variant), each target in a
child process of its own.

    python bench/bench_fp8_loop.py --target-layers 32 --json fp8-loop.json    one H100: 27B width, 32 layers
    python bench/bench_fp8_loop.py --target-layers 64                         the 27B shape (needs > 80 GB in bf16)

The bf16 27B target (54 GB) and its loop do not fit an 80 GB card; at the 27B width with fewer decoder layers
both fit. Any other flag goes to bench_length_mix (e.g. --kind dflash2, --pack-anchors 512, --steps 20). Printed:
each target's useful tokens/s, median and max step, recompiles, peak memory and fraction of the physical limit,
then the FP8 / bf16 ratio of useful tokens/s.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_length_mix  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target-layers", type=int, default=32, help="decoder layers of the 27B-wide target")
    p.add_argument("--targets", default="bf16,fp8", help="which targets, in this order")
    p.add_argument("--json", help="write both rows and the ratio here")
    args, rest = p.parse_known_args(argv)
    rows = {}
    for precision in [t.strip() for t in args.targets.split(",") if t.strip()]:
        child = ["--preset", "27b", "--target-layers", str(args.target_layers), *rest]
        child += ["--fp8-target"] if precision == "fp8" else []
        rows[precision] = bench_length_mix.run_in_child(child, "packed")
        rows[precision]["target"] = rows[precision]["variant"] = precision  # the report's first column
        print(json.dumps(rows[precision]), flush=True)
    done = [r for r in rows.values() if "error" not in r]
    print("\n" + bench_length_mix.report(done, None))
    result = {"target_layers": args.target_layers, "rows": rows}
    if {"bf16", "fp8"} <= {r["target"] for r in done}:
        result["fp8_over_bf16"] = rows["fp8"]["useful_tokens_per_s"] / rows["bf16"]["useful_tokens_per_s"]
        print(f"FP8 / bf16 whole loop at the 27B width, {args.target_layers} target layers: "
              f"{result['fp8_over_bf16']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if len(done) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
