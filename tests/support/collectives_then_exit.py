"""One rank of a run that ends right after its collectives, as every training process does: run by
tests/dflash/train/test_clean_exit.py under torchrun on a loaded CPU.

The collectives are the kinds a training run ends with (a tensor all-reduce, an object gather as in a DCP
save, the stop-flag check, a barrier); the process group's life is dflash.distributed.joined, as in
dflash-train. A group left for the interpreter's exit made such processes die with SIGABRT after their
work was done ("terminate called without an active exception").
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dflash import distributed


def main() -> int:
    with distributed.joined("cpu", cpu_threads=1) as d:
        for step in range(50):
            distributed.all_reduce_sum(d, torch.ones(1024))
            gathered = [None] * d.world_size
            dist.all_gather_object(gathered, {"rank": d.rank, "step": step})
            distributed.any_rank(d, False)
        distributed.barrier(d)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
