"""Where a layout keeps the drafter's weights, gradients and AdamW state, and all that follows from it.

A Layout's facts (dflash.config.layout) say two things about the drafter's state: whether each rank holds
all of it or 1/D of it (`shards_drafter`), and whether that share lives in host memory (`state_on_host`).
The behaviour they imply lives here, one class per way of keeping the state, so nothing else in the
training code asks those facts:

    Replicated   every rank holds the whole state; DDP averages the gradients (replicate)
    Sharded      FSDP2 shards it over the drafter's ranks, in host memory with the AdamW step on the
                 CPU where the layout says so (shard, offload, and the drafter ranks of pipeline)

Each one joins the process group it needs, wraps the drafter for the step, makes its optimizer, writes and
reads its checkpoints (whole files from rank 0, or DCP shards from every rank: the checkpoint's "kind"), and
gathers the whole drafter for an evaluation. Where the target's layers run (`target_in_stages`) is
dflash.train.parallel.pipeline's; what each layout costs, dflash.plan.memory's and dflash.plan.throughput's.
A new way of keeping the state is one class here and one entry in STATES.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash import distributed
from dflash.config import Layout, TrainConfig
from dflash.errors import CheckpointError, ConfigError
from dflash.train.parallel import sharded_checkpoint
from dflash.train.records import checkpoint as ckpt


class DrafterState:
    """The drafter's state as `layout` keeps it (a base: Replicated or Sharded, chosen by `of`)."""

    checkpoint_kind = ""  # what its checkpoints hold, recorded in them as sharded_checkpoint.KIND_KEY
    group_alone = False   # a process group even at world size 1

    def __init__(self, layout: Layout):
        self.layout = layout

    def check(self, config: TrainConfig) -> None:
        """Refuse, before anything loads, an option this way of keeping the state cannot serve."""

    def joined(self, config: TrainConfig):
        """Join the process group this layout needs for the length of a `with` block, which yields the Dist;
        the group is torn down when the block ends (dflash.distributed.joined)."""
        runtime = config.runtime
        return distributed.joined(runtime.device, cpu_threads=runtime.cpu_threads, group_alone=self.group_alone,
                                  host_collectives=self.layout.state_on_host)

    def wrap(self, drafter: torch.nn.Module, d: distributed.Dist, compile: bool = False) -> torch.nn.Module:
        """The module the trainer calls; `compile` compiles each decoder layer."""
        raise NotImplementedError

    def optimizer(self, drafter: torch.nn.Module, config: TrainConfig, d: distributed.Dist) -> torch.optim.AdamW:
        """AdamW over the drafter's (possibly sharded) parameters, fused on a GPU run: on the GPU, or on the
        CPU where the state lives in host memory (torch's fused CPU kernel)."""
        optim = config.optim
        return torch.optim.AdamW(drafter.parameters(), lr=optim.lr, weight_decay=optim.weight_decay,
                                 fused=d.device.type == "cuda")

    def save(self, root: Path, *, step: int, drafter, optimizer, scheduler, train_state: dict, config: TrainConfig,
             d: distributed.Dist) -> Path | None:
        """Write checkpoint `root/step-N`; its path where this rank learns it (None on ranks that do not)."""
        raise NotImplementedError

    def check_checkpoint(self, checkpoint: Path, state: dict) -> None:
        """Refuse a checkpoint written by a layout that keeps the state the other way (whole files vs DCP
        shards); `state` is its trainer_state.pt."""
        kind = state.get(sharded_checkpoint.KIND_KEY, Replicated.checkpoint_kind)
        if kind == self.checkpoint_kind:
            return
        if kind == Replicated.checkpoint_kind:
            raise CheckpointError(f"{checkpoint} was written by --layout replicate (whole optimizer state in "
                                  f"{ckpt.STATE_FILE}); --layout {self.layout.name} resumes sharded DCP checkpoints. "
                                  "Resume with --layout replicate, or start a new run without --resume.")
        raise CheckpointError(f"{checkpoint} holds sharded DCP state (written by --layout shard, offload or pipeline); "
                              f"--layout {self.layout.name} cannot read it. Resume with --layout shard (or offload, "
                              "or pipeline), at any world size.")

    def restore(self, checkpoint: Path, state: dict, drafter, optimizer, d: distributed.Dist) -> None:
        """Load a checkpoint's drafter weights and AdamW state into this run's drafter and optimizer."""
        raise NotImplementedError

    def whole(self, drafter: torch.nn.Module, d: distributed.Dist) -> torch.nn.Module | None:
        """The whole trained drafter on rank 0 (None elsewhere), for an evaluation; a collective where the
        state is sharded (every rank of the drafter calls it)."""
        raise NotImplementedError


class Replicated(DrafterState):
    """Every rank: the whole drafter, its gradients and AdamW state; DDP all-reduces the gradients (no process
    group at world size 1). Checkpoints are whole files written by rank 0."""

    checkpoint_kind = "full"

    def wrap(self, drafter, d, compile=False):
        """DDP (world size > 1) or the drafter itself; `compile`: Drafter.compile_layers."""
        if compile:
            drafter.compile_layers()
        if not d.enabled:
            return drafter
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(drafter, device_ids=[d.device.index] if d.device.type == "cuda" else None, process_group=d.group)

    def save(self, root, *, step, drafter, optimizer, scheduler, train_state, config, d):
        if not d.is_main:
            return None
        return ckpt.save_checkpoint(root, step=step, drafter=drafter, optimizer=optimizer, scheduler=scheduler,
                                    config=config, keep=config.runtime.keep_checkpoints, train_state=train_state)

    def restore(self, checkpoint, state, drafter, optimizer, d):
        from safetensors.torch import load_file

        self.check_checkpoint(checkpoint, state)
        drafter.load_state_dict(ckpt.load_weights(checkpoint, load_file, device=str(d.device)))
        optimizer.load_state_dict(state["optimizer"])

    def whole(self, drafter, d):
        return drafter


class Sharded(DrafterState):
    """Each drafter rank: 1/D of the drafter's fp32 weights, gradients and AdamW state (FSDP2 fully_shard per
    decoder layer, then the root); in pinned host memory with the AdamW step on the CPU where the layout keeps
    the state on the host (FSDP2's CPUOffloadPolicy). A process group even at world size 1. Checkpoints are
    DCP shards from every rank, resharded on load (dflash.train.parallel.sharded_checkpoint)."""

    checkpoint_kind = "dcp"
    group_alone = True

    def check(self, config):
        if config.watch.eval_tau_prompts and config.watch.has_eval_split:
            raise ConfigError(f"--eval-tau-prompts decodes with the whole drafter on rank 0, and --layout "
                              f"{self.layout.name} holds it in shards across the ranks; drop --eval-tau-prompts (the "
                              "evaluation's loss, accuracy and acceptance still run) and measure tau on the exported "
                              "drafter with dflash-eval, or train with --layout replicate.")

    def wrap(self, drafter, d, compile=False):
        """The drafter sharded in place. `compile` compiles each layer's forward (FSDP2's gather and reshard
        hooks run around it, outside the compiled code: a Module.compile()d layer is called past its compiled
        code once fully_shard wraps it); static shapes, as Drafter.compile_layers says why."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        mesh = DeviceMesh.from_group(d.group, d.device.type) if d.group is not None else None
        on_host = self.layout.state_on_host
        extra = {"offload_policy": CPUOffloadPolicy(pin_memory=d.device.type == "cuda")} if on_host else {}
        for layer in drafter.layers:
            fully_shard(layer, mesh=mesh, **extra)
        fully_shard(drafter, mesh=mesh, **extra)
        if compile:
            for layer in drafter.layers:
                layer.forward = torch.compile(layer.forward, dynamic=False)
        return drafter

    def save(self, root, *, step, drafter, optimizer, scheduler, train_state, config, d):
        return sharded_checkpoint.save(root, step=step, drafter=drafter, optimizer=optimizer, scheduler=scheduler,
                                       train_state=train_state, config=config,
                                       keep=config.runtime.keep_checkpoints, d=d)

    def restore(self, checkpoint, state, drafter, optimizer, d):
        self.check_checkpoint(checkpoint, state)
        sharded_checkpoint.load(checkpoint, drafter, optimizer, d.group)

    def whole(self, drafter, d):
        plain = sharded_checkpoint.full_drafter(drafter, d.rank)
        return plain.to(d.device) if plain is not None else None


# by Layout.shards_drafter
STATES: dict[bool, type[DrafterState]] = {False: Replicated, True: Sharded}


def of(layout: Layout) -> DrafterState:
    """The drafter state `layout` keeps."""
    return STATES[layout.shards_drafter](layout)
