"""gloo's worker threads of this process, by name, and a rank that trains and then reports them.

    python -m torch.distributed.run --nproc-per-node 2 -m tests.support.gloo_threads train ARGS...

runs `dflash-train ARGS` in each rank and exits 3 when a gloo worker thread ("pt_gloo_runloop", named by
gloo in /proc/self/task/*/comm) is still alive after the run returned: a process group that outlives its
run is destroyed during the interpreter's finalization, where it can abort the process
(dflash.distributed.close). Used by tests/dflash/train/test_clean_exit.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def gloo_threads() -> list[str]:
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # a thread that ended while we looked
            continue
    return sorted(n for n in names if "gloo" in n)


def main(argv: list[str]) -> int:
    from dflash.cli import main as cli_main

    rc = cli_main(argv)
    left = gloo_threads()
    print(f"rank {os.environ.get('RANK', '0')}: dflash-train exit {rc}; gloo threads left: {left}", flush=True)
    return rc or (3 if left else 0)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
