"""One process per device, through torch.distributed (the launcher is torchrun).

The same code runs as a plain single process (no RANK in the environment: world size 1, no process
group) and under `torchrun --nproc-per-node N` (NCCL on GPUs, gloo on CPU). Each rank loads its own
frozen target; only the drafter is wrapped in DDP.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before any group exists: see _drop_group_references


@dataclass(frozen=True)
class Dist:
    """Where this process sits: rank, world size, and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    group: object = None  # the ranks' process group (None: all of them); rank and world_size count in it
    owns_group: bool = False  # init() made the default process group, so close() destroys it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def pick_device(spec: str, local_rank: int) -> torch.device:
    """'auto' -> cuda:LOCAL_RANK when a GPU is there, else cpu; 'cuda' -> cuda:LOCAL_RANK."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda":
        spec = f"cuda:{local_rank}"
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {spec}: no CUDA GPU is visible to this process. "
                               "Use --device cpu, or check the GPU passthrough (nvidia-smi).")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise RuntimeError(f"--device {spec}: only {torch.cuda.device_count()} GPU(s) are visible. "
                               "Lower --nproc-per-node or pick another device.")
        torch.cuda.set_device(device)
    return device


def init(device_spec: str = "auto", timeout_s: float = 1800, cpu_threads: int = 0, *,
         group_alone: bool = False, host_collectives: bool = False) -> Dist:
    """Join the process group when launched by torchrun (RANK/WORLD_SIZE set); otherwise run alone.

    `cpu_threads` > 0 caps torch's intra-op threads: on a shared or small machine, OpenMP threads that
    wait for a descheduled sibling can make small CPU ops tens of times slower. `group_alone` makes a
    process group of one when there is no torchrun (FSDP2 shards over a device mesh, which needs a
    group even at world size 1). `host_collectives` adds gloo for CPU tensors beside NCCL on a GPU
    (FSDP2's CPU offload clips gradients that live in host memory).
    """
    if cpu_threads > 0:
        torch.set_num_threads(cpu_threads)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_spec, local_rank)
    owns_group = (world_size > 1 or group_alone) and not dist.is_initialized()
    if owns_group:
        backend = "gloo"
        if device.type == "cuda":
            backend = "cpu:gloo,cuda:nccl" if host_collectives else "nccl"
        alone = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if world_size == 1 else {}
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **alone,
                                **({"device_id": device} if device.type == "cuda" else {}))
    return Dist(rank=rank, world_size=world_size, local_rank=local_rank, device=device, owns_group=owns_group)


def close(d: Dist, *, clean: bool = True) -> None:
    """Tear down the process group init() made, while the interpreter is still whole.

    A group left for the interpreter's exit is destroyed during finalization: a gloo worker thread that
    still holds a finished collective then frees its tensors, needs the GIL, and the process dies with
    "terminate called without an active exception" (SIGABRT) after its work is done (pytorch#179291).
    `clean`: every rank got here; a barrier first drains the collectives in flight on all of them. After
    an error the ranks are not in step: no barrier, and only a gloo-only group is destroyed (NCCL's
    teardown can block on a peer still inside a collective, pytorch/torchtitan#1342; the process's exit
    ends it).
    """
    if not (d.owns_group and dist.is_initialized()):
        return
    if clean:
        dist.barrier()
    elif d.device.type == "cuda":
        return
    dist.destroy_process_group()
    _drop_group_references()


def _drop_group_references() -> None:
    """Let the destroyed groups' C++ objects, and with them gloo's worker threads, go now, not at the exit.

    destroy_process_group() forgets the groups, but torch objects still hold them, and a group that lives
    into the interpreter's finalization can abort the process (close()'s docstring): each DeviceMesh in its
    `_pg_registry` (DTensor's sharding caches keep meshes for the life of the process), and FSDP2's mesh
    infos while the drafter lives (a run returns it). torch.distributed.nn's functions would hold the
    default group in their defaults (`group=group.WORLD`) had they been imported after init_process_group
    (transformers imports them while it loads the target): this module imports them first. Every group is
    destroyed by now, so every reference dropped here points at a dead one.
    """
    import gc

    from torch.distributed.device_mesh import DeviceMesh
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import DataParallelMeshInfo
    except ImportError:  # a torch that moved it: its mesh infos keep the group until the drafter goes
        DataParallelMeshInfo = ()
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: that reads __class__, and deprecated torch objects warn on it
        if issubclass(kind, DeviceMesh):
            getattr(obj, "_pg_registry", {}).clear()
        elif issubclass(kind, DataParallelMeshInfo):
            for name in ("shard_process_group", "replicate_process_group"):
                if hasattr(obj, name):
                    setattr(obj, name, None)


@contextmanager
def joined(device_spec: str = "auto", **init_options) -> Iterator[Dist]:
    """init() for the length of a `with` block, then close(): the whole life of a run's process group."""
    d = init(device_spec, **init_options)
    try:
        yield d
    except BaseException:
        close(d, clean=False)
        raise
    close(d)


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier(group=d.group)


def all_reduce_sum(d: Dist, t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks (in place); a no-op in a single process."""
    if d.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=d.group)
    return t


def any_rank(d: Dist, flag: bool) -> bool:
    """True on every rank when `flag` is True on at least one (e.g. a stop signal reached one rank)."""
    if not d.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=d.group)
    return bool(t.item() > 0)


def max_over_ranks(d: Dist, value: int) -> int:
    """The largest of every rank's `value` (small whole numbers: a stop status), on every rank."""
    if not d.enabled:
        return value
    t = torch.tensor([float(value)], device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=d.group)
    return int(t.item())


def shard(items: list, d: Dist) -> list:
    """This rank's share of one global micro-batch: items rank, rank+W, rank+2W, ...

    A rank can get nothing when the batch holds fewer sequences than there are ranks; it then runs a
    zero-weight stand-in (dflash.batching.shares), so that its collectives stay in step with the other ranks'.
    """
    return items[d.rank::d.world_size]
