"""Many dflash-train runs on several world sizes for the price of one interpreter start: run by
tests/dflash/train/test_ranks_in_step.py.

    python -m tests.support.ranks_in_step PLAN.json

PLAN.json: {"timeout_s": a collective's time limit, "results": a folder, "phases": [{"world", "runs": [{"name",
"argv", "exit", "sigterm_rank"}, ...]}, ...]}. This process imports what a run needs (torch, transformers, fla,
dflash: most of a start's time), then for each phase, one after another, forks one process per rank. Those join
one gloo process group (dflash.distributed.joined on 127.0.0.1, a collective waiting at most timeout_s: one that a
rank never reaches fails instead of hanging) and run the phase's runs one after another, each joining that group
as a run under torchrun joins its own (a world of 1 runs them without a group). Rank R of world W writes its
output to <results>/<W>-<R>.log and, after each run, a line {"name", "exit"} to <results>/<W>-<R>.jsonl. A run
that ends with another exit code than "exit" ({rank: code}, 0 where not named) ends the phase on that rank (its
ranks may be out of step); the next phase goes on. Each phase gets fresh processes: DTensor caches its shardings
by the ranks of a device mesh, not by its group, so a second group over the same ranks in one process would be
handed the first one's name after it is gone.

"sigterm_rank": that rank sends itself SIGTERM as it starts the drafter's first forward of the run's first
evaluation (a real signal, taken by the run's own handler), so that a test can tell what a signal during an
evaluation does.

Every process of a launch is in its process group: the test ends them all at once when the launch runs too long.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import sys
from contextlib import nullcontext
from pathlib import Path

# what a run imports on its way (the target's model code, the kernels' fallbacks, FSDP2, DCP, the report's plots)
WARM = ("dflash.cli", "dflash.train.trainer", "dflash.train.multi", "dflash.model.target", "dflash.data.token_cache",
        "transformers.models.qwen3_5.modeling_qwen3_5", "torch.distributed.fsdp", "torch.distributed.checkpoint",
        "dflash.train.records.run_report", "matplotlib.pyplot")


class _OutOfStep(Exception):
    """A run ended unexpectedly: the phase's group is left without a closing barrier."""


def _sigterm_in_first_evaluation() -> None:
    """SIGTERM to this process at the first call of micro_batch_sums made from dflash/train/evaluation.py."""
    import dflash.train.evaluation as evaluation
    from dflash.train.step import micro_batch_sums

    forward, home = micro_batch_sums.__code__, evaluation.__file__

    def profile(frame, event, _arg):
        if event == "call" and frame.f_code is forward and frame.f_back.f_code.co_filename == home:
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGTERM)

    sys.setprofile(profile)


def _rank(phase: dict, rank: int, port: int, timeout_s: float, results: Path) -> None:
    """One rank of a phase: its runs, one after another."""
    from dflash import distributed
    from dflash.cli import train_main

    world = phase["world"]
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    with distributed.joined("cpu", timeout_s=timeout_s) if world > 1 else nullcontext():
        for run in phase["runs"]:
            if run.get("sigterm_rank") == rank:
                _sigterm_in_first_evaluation()
            code = train_main(run["argv"])
            sys.setprofile(None)
            with open(results / f"{world}-{rank}.jsonl", "a") as fh:
                fh.write(json.dumps({"name": run["name"], "exit": code}) + "\n")
            if code != run.get("exit", {}).get(str(rank), 0):
                raise _OutOfStep(run["name"])


def _fork_rank(phase: dict, rank: int, port: int, timeout_s: float, results: Path) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        log = os.open(results / f"{phase['world']}-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        _rank(phase, rank, port, timeout_s, results)
    except _OutOfStep as exc:
        print(f"rank {rank} of {phase['world']}: stopped at {exc}", flush=True)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # its results are written; nothing is left for an interpreter's finalization to trip on


def main(plan_path: str) -> int:
    plan = json.loads(Path(plan_path).read_text())
    results = Path(plan["results"])
    for name in WARM:
        importlib.import_module(name)
    for phase in plan["phases"]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ranks = [_fork_rank(phase, rank, port, plan["timeout_s"], results) for rank in range(phase["world"])]
        for pid in ranks:
            os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
