"""What went wrong underneath a failed collective or checkpoint, said in one line and sorted by cause.

torch.distributed.checkpoint wraps every rank's error in one CheckpointException, which derives from
BaseException (so `except Exception` misses it) and whose str() is a traceback per rank. A collective
whose peer process went away raises a gloo or NCCL error (DistBackendError, or a RuntimeError naming
the transport). The trainer turns each into the error a user can act on:

    disk full, over quota, read-only   -> free space (dflash.train.records.checkpoint.DISK_ERRNOS)
    another rank went away             -> RankLostError: look at that rank's output, then --resume
    anything else                      -> the causes, one line each, no traceback
"""

from __future__ import annotations

from dflash.errors import RankLostError
from dflash.train.records.checkpoint import DISK_ERRNOS

# what gloo and NCCL say when the other end of a collective is gone (a killed, crashed or exited peer)
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
              "socket closed", "remote process exited", "nccl communicator was aborted")


def causes(exc: BaseException) -> list[tuple[int | None, BaseException]]:
    """(rank, error) underneath `exc`: one per failing rank of a CheckpointException, else (None, exc)
    and, when it has one, its __cause__ chain."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return [(rank, wrapped[0]) for rank, wrapped in sorted(failures.items())]
    found, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        found.append((None, exc))
        exc = exc.__cause__
    return found


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, at most 200 characters (a gloo message names its source file)."""
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def summary(exc: BaseException) -> str:
    """Every cause of `exc` in one line each, joined with '; ' (rank-prefixed for a DCP failure)."""
    return "; ".join((f"rank {rank}: " if rank is not None else "") + one_line(e) for rank, e in causes(exc))


def disk_cause(exc: BaseException) -> OSError | None:
    """The disk error (full, over quota, read-only) underneath `exc`, if that is what it is."""
    return next((e for _, e in causes(exc) if isinstance(e, OSError) and e.errno in DISK_ERRNOS), None)


def is_peer_lost(exc: BaseException) -> bool:
    """Whether `exc` says that another process of the run went away in the middle of a collective."""
    import torch.distributed as dist

    for _, e in causes(exc):
        if isinstance(e, RankLostError):
            return True
        text = str(e).lower()
        if isinstance(e, (dist.DistBackendError, dist.DistNetworkError, RuntimeError, ConnectionError)) and \
                any(words in text for words in _PEER_GONE):
            return True
    return False


def rank_lost(exc: BaseException, rank: int, step: int, latest: str | None) -> RankLostError:
    """The error a surviving rank stops with when a peer went away at optimizer step `step`."""
    then = (f"then continue from its last checkpoint ({latest}) with --resume" if latest else
            "then run it again (no checkpoint was written yet)")
    return RankLostError(
        f"rank {rank} lost another process of the run at step {step} ({one_line(causes(exc)[-1][1])}). That "
        "process stopped first: its own output, or the launcher's line naming its exit code or signal, says why "
        f"(a crash, a kill, the out-of-memory killer). Fix that, {then}.")
