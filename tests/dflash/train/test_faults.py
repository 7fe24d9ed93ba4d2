"""dflash.train.faults sorts what lies under a failed collective or DCP save: a peer that went away is not
a full disk (it was reported as "Free disk space"), and DCP's per-rank traceback becomes one line a rank."""

from __future__ import annotations

import errno
import traceback

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from dflash.errors import RankLostError
from dflash.train import faults

GLOO_PEER_GONE = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:538] Read error [127.0.0.1]:52373: "
                  "Connection reset by peer")


def _dcp_failure(**errors_by_rank) -> CheckpointException:
    failures = {int(rank.removeprefix("rank")): (exc, traceback.StackSummary()) for rank, exc in errors_by_rank.items()}
    return CheckpointException("save failed", failures)


def test_a_peer_gone_inside_a_dcp_save_is_a_lost_rank_not_a_full_disk():
    exc = _dcp_failure(rank1=RuntimeError(GLOO_PEER_GONE))
    assert faults.is_peer_lost(exc) and faults.disk_cause(exc) is None
    assert faults.summary(exc) == f"rank 1: RuntimeError: {GLOO_PEER_GONE}"


def test_a_full_disk_inside_a_dcp_save_is_named_with_its_rank():
    exc = _dcp_failure(rank0=OSError(errno.ENOSPC, "No space left on device"))
    assert faults.disk_cause(exc).errno == errno.ENOSPC and not faults.is_peer_lost(exc)
    assert "Traceback" not in faults.summary(exc) and "rank 0: OSError" in faults.summary(exc)


def test_backend_errors_and_a_wrapped_cause_count_as_a_lost_peer():
    assert faults.is_peer_lost(dist.DistBackendError("NCCL communicator was aborted on rank 1"))
    wrapped = RuntimeError("step failed")
    wrapped.__cause__ = ConnectionResetError("Connection reset by peer")
    assert faults.is_peer_lost(wrapped)
    assert not faults.is_peer_lost(RuntimeError("shape '[1534, 256]' is invalid for input of size 1024"))


def test_the_survivors_message_names_rank_step_and_the_way_on():
    error = faults.rank_lost(RuntimeError(GLOO_PEER_GONE), rank=0, step=7, latest="step-00000006")
    assert isinstance(error, RankLostError) and error.exit_code == 11
    text = str(error)
    assert "rank 0 lost another process of the run at step 7" in text
    assert "continue from its last checkpoint (step-00000006) with --resume" in text
