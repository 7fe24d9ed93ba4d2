"""--layout: what each of its names means for a rank. The one place a layout is told apart by its name;
everywhere else asks a Layout what it does (tests/dflash/test_layering.py holds that).

    replicate  every rank: the whole target, the whole drafter, its gradients and AdamW state (DDP)
    shard      every rank: the whole target and 1/W of the drafter's fp32 weights, gradients and AdamW state
               (FSDP2)
    offload    shard, with that share in host memory and the AdamW step on the CPU
    pipeline   the target's layers in stages on their own ranks; the drafter sharded (as shard) over the others

What the facts do: dflash.train.parallel.drafter_state (how the drafter's state is kept: the process group, the
wrapper, the optimizer, the checkpoints, the whole drafter gathered), dflash.train.parallel.pipeline (the target's
stages), dflash.train.parallel.layouts (a launch checked against its layout); what each costs: dflash.plan.memory
and dflash.plan.throughput.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    """One --layout, by what it does."""

    name: str
    shards_drafter: bool     # each drafter rank holds 1/D of the drafter's weights, gradients and AdamW state
    state_on_host: bool      # that share lives in host memory, and the AdamW step runs on the CPU
    target_in_stages: bool   # the target's layers run in stages on ranks of their own (point-to-point sends)

    def __post_init__(self) -> None:
        """Refuse a combination of facts that no code implements, by what is missing, as the layout is made
        (at import: before any option is parsed or weight loaded)."""
        missing = UNIMPLEMENTED.get((self.shards_drafter, self.state_on_host, self.target_in_stages))
        if missing:
            raise ConfigError(f"layout {self.name!r}: {missing}; the layouts that run are "
                              f"{', '.join(IMPLEMENTED.values())}")

    @property
    def min_world(self) -> int:
        """Fewest processes it runs on (a pipeline needs a drafter rank beside a stage rank)."""
        return 2 if self.target_in_stages else 1

    @classmethod
    def of(cls, name: str) -> "Layout":
        for layout in ALL:
            if layout.name == name:
                return layout
        raise ConfigError(f"layout {name!r}: choose one of {', '.join(LAYOUTS)}")


# (shards_drafter, state_on_host, target_in_stages): every combination, with who implements it or what is missing
IMPLEMENTED = {
    (False, False, False): "replicate (DDP)",
    (True, False, False): "shard (FSDP2)",
    (True, True, False): "offload (FSDP2 with CPU offload, AdamW on the CPU)",
    (True, False, True): "pipeline (target stages, FSDP2 over the drafter ranks)",
}
UNIMPLEMENTED = {
    (False, True, False): "drafter state in host memory needs a sharded drafter (FSDP2's CPU offload); DDP "
                          "keeps its state on the device",
    (False, True, True): "drafter state in host memory needs a sharded drafter, and the target stages feed only a "
                         "sharded drafter",
    (False, False, True): "the target stages feed a sharded drafter (FSDP2 over the drafter ranks); a replicated "
                          "drafter beside target stages is not built",
    (True, True, True): "target stages beside a drafter whose state is in host memory are not built (the memory "
                        "model and the pipeline's sends assume the state on the device)",
}

ALL = (
    Layout("replicate", shards_drafter=False, state_on_host=False, target_in_stages=False),
    Layout("shard", shards_drafter=True, state_on_host=False, target_in_stages=False),
    Layout("offload", shards_drafter=True, state_on_host=True, target_in_stages=False),
    Layout("pipeline", shards_drafter=True, state_on_host=False, target_in_stages=True),
)
LAYOUTS = tuple(layout.name for layout in ALL)
