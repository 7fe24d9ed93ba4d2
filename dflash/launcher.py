"""`dflash-train --nproc-per-node N ...`: torchrun's launch, run in this process, ending with the run's
own exit code.

Plain `torchrun` turns any worker's failure into its own traceback (ChildFailedError) and exit 1, so a
scheduler cannot tell a refused option (2) from a lost rank (11) or a stopped run (143). This is the same
launch (torch.distributed.run's parser and elastic agent, `--standalone`: one node, a free port), with
the first failing worker's code as the launcher's: a code of its own, or 128 + the signal that killed
it; one line names every rank that did not exit 0, with its code (torchrun's own line names the first).
The workers are `python -m dflash.cli train` with the remaining arguments, as under torchrun. A SIGTERM
to the launcher reaches every worker (each finishes its step, checkpoints and exits 143, within the
30 s torchrun's agent gives them before SIGKILL); a SIGKILL of the launcher reaches them as SIGTERM too
(dflash.train.signals), so no worker trains on without it.
"""

from __future__ import annotations

import logging
import sys

NPROC_FLAG = "--nproc-per-node"


def split_launch(argv: list[str]) -> tuple[int | None, list[str]]:
    """(N of --nproc-per-node N / --nproc-per-node=N, or None; the other arguments)."""
    rest, nproc = [], None
    it = iter(range(len(argv)))
    for i in it:
        arg = argv[i]
        if arg == NPROC_FLAG and i + 1 < len(argv):
            nproc = argv[i + 1]
            next(it, None)
        elif arg.startswith(NPROC_FLAG + "="):
            nproc = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if nproc is None:
        return None, argv
    from dflash.errors import ConfigError

    if not nproc.isdigit() or int(nproc) < 1:
        raise ConfigError(f"{NPROC_FLAG} {nproc!r}: give the number of processes to start on this machine (one per "
                          "GPU), a whole number of at least 1.")
    return int(nproc), rest


def exit_code_of(failure) -> int:
    """A worker's exit as a shell reports it: its code, or 128 + the signal that ended it."""
    code = int(failure.exitcode)
    return 128 - code if code < 0 else code


def exits_text(failures: dict, first: int) -> str:
    """The ranks that did not exit 0 with their codes (as exit_code_of counts them), the first one first: a
    stopped run shows every rank stopped, a crash which rank went first."""
    if len(failures) == 1:
        return f"rank {first} exited with {exit_code_of(failures[first])}"
    rest = ", ".join(f"rank {r} with {exit_code_of(failures[r])}" for r in sorted(failures) if r != first)
    return f"rank {first} exited with {exit_code_of(failures[first])} first, then {rest}"


def launch(nproc: int, train_argv: list[str]) -> int:
    """Start `nproc` training processes on this machine and wait; returns the run's exit code (0, or the
    first failing worker's)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(["--standalone", f"{NPROC_FLAG}={nproc}", "-m", "dflash.cli", "train",
                                         *train_argv])
    # the agent's own INFO lines (rendezvous, restarts) say nothing a training user needs
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    try:
        run(args)
    except ChildFailedError as exc:  # the workers have said why; the code is the first one's
        rank, failure = exc.get_first_failure()
        print(f"dflash-train: {exits_text(exc.failures, rank)}", file=sys.stderr, flush=True)
        return exit_code_of(failure)
    except SignalException as exc:  # the launcher itself got SIGTERM/SIGINT: the workers got it too
        return 128 + int(exc.sigval)
    return 0
