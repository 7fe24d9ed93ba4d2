"""--layout: how the ranks share the frozen target, the drafter and its optimizer state.

    replicate  every rank: the whole target, the whole drafter, its gradients and AdamW state; gradients
               averaged by DDP (all-reduce). The only layout without a process group at world size 1.
    shard      every rank: the whole target; 1/W of the drafter's fp32 weights, gradients and AdamW
               state (FSDP2 fully_shard per drafter layer, then the root: a layer's weights are gathered
               for its forward and backward, its gradients reduce-scattered).
    offload    shard, with the sharded weights, gradients and AdamW state in (pinned) host memory and the
               AdamW step on the CPU (FSDP2 CPUOffloadPolicy); the GPU holds the target, one gathered
               drafter layer at a time and the activations. Valid at world size 1: one 96 GB card.
    pipeline   ranks 0..D-1 (D = W - S, S = --target-stages): the target's embedding and LM head, and the
               drafter, sharded (as shard) among themselves; ranks D..W-1: one contiguous stage of the
               target's layers each. Each micro-batch's tapped hidden states go from the stages to the
               drafter ranks by point-to-point sends (dflash.train.parallel.pipeline).

Every layout computes the gradient one process computes on the whole global micro-batch, so a run's
losses and weights do not depend on the layout or the world size (to float rounding). What each name means
is dflash.config.layout's Layout (config.layout). This module checks a launch against its layout and splits
a pipeline's ranks; how each layout keeps the drafter's state (the group joined, the wrapper, the optimizer,
the checkpoints) is dflash.train.parallel.drafter_state, from the layout's facts, never its name.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from dflash.config import TrainConfig
from dflash.train.parallel import drafter_state
from dflash.errors import ConfigError


@dataclass(frozen=True)
class PipelineRoles:
    """Who holds what under --layout pipeline: ranks 0..D-1 train the drafter; rank D+s holds the target
    layers [start, stop) = `stages[s]`."""

    stages: tuple[tuple[int, int], ...]
    world_size: int

    @property
    def drafter_ranks(self) -> list[int]:
        return list(range(self.world_size - len(self.stages)))

    @property
    def stage_ranks(self) -> list[int]:
        return list(range(self.world_size - len(self.stages), self.world_size))

    def stage_of_layer(self, layer: int) -> int:
        return next(s for s, (a, b) in enumerate(self.stages) if a <= layer < b)


def target_stages(config: TrainConfig, world_size: int) -> int:
    """--target-stages, or (0) half the ranks rounded up."""
    return config.runtime.target_stages or math.ceil(world_size / 2)


def pipeline_roles(config: TrainConfig, world_size: int, num_layers: int) -> PipelineRoles:
    """Contiguous stages by layer count: the first num_layers % S stages take one layer more."""
    n_stages = target_stages(config, world_size)
    if n_stages > num_layers:
        raise ConfigError(f"--target-stages {n_stages} is more than the target's {num_layers} layers; pass "
                          f"--target-stages {num_layers} or fewer.")
    base, extra = divmod(num_layers, n_stages)
    bounds, start = [], 0
    for s in range(n_stages):
        stop = start + base + (1 if s < extra else 0)
        bounds.append((start, stop))
        start = stop
    return PipelineRoles(stages=tuple(bounds), world_size=world_size)


def check_layout(config: TrainConfig, world_size: int | None = None) -> None:
    """Refuse a layout this launch cannot run (world size: torchrun's WORLD_SIZE), before anything is
    loaded, naming the fix."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    drafter_state.of(config.layout).check(config)
    if not config.layout.target_in_stages:
        return
    if world_size < config.layout.min_world:
        raise ConfigError("--layout pipeline splits the target from the drafter across processes and this run "
                          "has one; launch it with torchrun --nproc-per-node 2 (or more), or use --layout offload "
                          "on one card.")
    stages = target_stages(config, world_size)
    if stages >= world_size:
        raise ConfigError(f"--target-stages {stages} leaves none of the {world_size} ranks to train the drafter; "
                          f"pass --target-stages {world_size - 1} or fewer.")
    if config.watch.has_eval_split:
        raise ConfigError("--layout pipeline cannot evaluate during training (the evaluation runs the whole target "
                          "on one rank); drop --eval-data/--eval-fraction and evaluate the exported drafter with "
                          "dflash-eval afterwards.")


def clip_grad_norm(drafter: torch.nn.Module, clip: float) -> torch.Tensor:
    """Clip the global gradient norm (over all shards) to `clip`; returns the norm before clipping as a
    plain tensor (FSDP2 returns a replicated DTensor), NaN when clipping is off."""
    if clip <= 0:
        return torch.tensor(float("nan"))
    norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), clip)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
