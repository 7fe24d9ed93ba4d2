"""Build benchmark: the target's single arch vs upstream's default arch list, and a warm rebuild.

    python bench/bench_build.py --target cu130-sm120          (make bench-build)

Runs native builds (nvcc and the target's torch must be installed here; the Docker builder runs the
same code) side by side in one process:
  1. cold, the target's arch only (ccache off)
  2. cold, two arches (ccache off) -> the cost of one more arch
  3. upstream's default list (9 arches at CUDA 13) is EXTRAPOLATED from 1 and 2:
     t(n) = t1 + (n - 1) * (t2 - t1); building all nine here would take most of an hour on 2 cores
  4. warm: the single-arch build again, with the ccache that build 1 filled
and prints a table with the ratios. Figures go into the README with this command.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from wheelbuilder import targets as tg
from wheelbuilder.build import build_target


def timed_build(target: tg.Target, work: Path, name: str, ccache: bool) -> float:
    out = work / name
    env_backup = dict(os.environ)
    if ccache:
        os.environ["CCACHE_DIR"] = str(work / "ccache")
        os.environ.pop("WHEELBUILDER_NO_CCACHE", None)
    else:
        os.environ["WHEELBUILDER_NO_CCACHE"] = "1"
    try:
        started = time.monotonic()
        build_target(target, out, build_root=work / "build", log_dir=work / "logs" / name)
        return time.monotonic() - started
    finally:
        os.environ.clear()
        os.environ.update(env_backup)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="cu130-sm120", help="target from targets.toml")
    p.add_argument("--second-arch", default="9.0", help="the extra arch of the two-arch build")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args()
    target = tg.load().target(args.target)
    recipe = target.recipes[0]
    upstream_n = len(recipe.upstream_arches)
    two = tg.with_arches(target, ",".join([str(target.arches[0]), args.second_arch]))
    work = Path(tempfile.mkdtemp(prefix="bench-build-"))
    try:
        # The first build is cold (an empty ccache directory, so every object is a miss) and fills the
        # cache the warm rebuild then reads; the two-arch build bypasses ccache.
        t1 = timed_build(target, work, "one-arch", ccache=True)
        t2 = timed_build(two, work, "two-arches", ccache=False)
        warm = timed_build(target, work, "warm", ccache=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    per_arch = max(t2 - t1, 0.0)
    upstream = t1 + (upstream_n - 1) * per_arch
    print(f"\nbuild benchmark: {recipe.name} {recipe.version}, target {target.name}, {os.cpu_count()} cores")
    print(f"  {'build':<44} {'seconds':>8} {'vs 1 arch':>10}")
    rows = [(f"cold, 1 arch ({target.arches[0]})", t1), (f"cold, 2 arches (+{args.second_arch})", t2),
            (f"upstream default, {upstream_n} arches (extrapolated)", upstream), ("warm rebuild (ccache)", warm)]
    for name, t in rows:
        print(f"  {name:<44} {t:>8.0f} {t / t1:>9.2f}x")
    print(f"  one extra arch costs {per_arch:.0f} s; the target's single arch is {upstream / t1:.1f}x faster than "
          "upstream's list; a fully unchanged `make wheels` reuses the Docker layer and takes seconds.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
