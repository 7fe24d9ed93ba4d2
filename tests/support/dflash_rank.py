"""A rank of a dflash-train run under torchrun, for the fault tests: it says what it exited with, and it can
hold one DCP checkpoint write open, as a slow filesystem holds it.

    [HELD_DCP_STEP=N HELD_DCP_DIR=DIR] python -m torch.distributed.run --nproc-per-node 2 \
        -m tests.support.dflash_rank train ARGS...

runs `dflash train ARGS` in each rank and ends it by printing `rank R: dflash exit CODE` to stderr (what
dflash returned, before torchrun's view of the process). With HELD_DCP_STEP and HELD_DCP_DIR, a rank that
has opened its first shard file of checkpoint step-N (inside the hidden `.tmp-step-N-dcp`, before a byte
of it is written) writes its pid to DIR/rank-R and waits until DIR/release exists (at most
HELD_DCP_SECONDS, 300 by default) before it writes on: a test that signals the job once every rank's file
is there lands the signal inside the write, every time. Used by tests/dflash/train/test_multiprocess_faults.py
and test_signals_mid_checkpoint.py.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path


def _hold(path: str) -> None:
    step, folder = os.environ.get("HELD_DCP_STEP"), os.environ.get("HELD_DCP_DIR")
    if not (step and folder and path.endswith(".distcp") and f".tmp-step-{int(step):08d}-dcp" in path):
        return
    mark = Path(folder) / f"rank-{os.environ.get('RANK', '0')}"
    if mark.exists():  # this rank's first shard file only
        return
    mark.write_text(str(os.getpid()))
    deadline = time.monotonic() + float(os.environ.get("HELD_DCP_SECONDS", "300"))
    while time.monotonic() < deadline and not (Path(folder) / "release").exists():
        time.sleep(0.05)


def hold_dcp_writes() -> None:
    """Wrap DCP's FileSystem.create_stream so that it holds the first shard file of step HELD_DCP_STEP."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    opened = FileSystem.create_stream

    @contextmanager
    def create_stream(self, path, mode):
        with opened(self, path, mode) as stream:
            if "w" in mode:
                _hold(str(path))
            yield stream

    FileSystem.create_stream = create_stream


def main(argv: list[str]) -> int:
    from dflash.cli import main as cli_main

    hold_dcp_writes()
    code = cli_main(argv)
    print(f"rank {os.environ.get('RANK', '0')}: dflash exit {code}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
