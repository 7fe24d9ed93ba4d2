"""Step changes of the training loop undone one by one, side by side in one run on one card: the packed
variant of bench/bench_length_mix.py once per lever set, each in a child process of its own.

    python bench/bench_levers.py --preset 27b --fp8-target --json levers.json       one H100: the 27B FP8 loop
    python bench/bench_levers.py --sets "norms,bounds;bounds;" --steps 12           which rows, in this order

--sets is a ';'-separated list of --without values (bench_length_mix.LEVERS; empty: every change in): the
default runs everything undone first (the code before the changes), then one change in at a time, then all.
Any other flag goes to bench_length_mix. Printed: one row per set (useful tokens/s, median and max step,
recompiles, peak memory, fraction of the physical limit) and each row's speed against the first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_length_mix  # noqa: E402

DEFAULT_SETS = "norms,bounds;bounds;"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sets", default=DEFAULT_SETS, help="';'-separated --without values, in the order to run")
    p.add_argument("--json", help="write the rows here (rewritten after each)")
    args, rest = p.parse_known_args(argv)
    rows = []
    for undone in args.sets.split(";"):
        row = bench_length_mix.run_in_child([*rest, "--without", undone], "packed")
        row["variant"] = "without " + undone if undone else "all in"
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    done = [r for r in rows if "error" not in r]
    print("\n" + bench_length_mix.report(done, None))
    if done:
        for r in done[1:]:
            print(f"{r['variant']}: {r['useful_tokens_per_s'] / done[0]['useful_tokens_per_s']:.3f}x "
                  f"'{done[0]['variant']}', median step {r['median_step_s'] - done[0]['median_step_s']:+.3f} s")
    return 0 if len(done) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
