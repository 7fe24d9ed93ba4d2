"""Which --layout fits a card, and the check training runs before it loads the target.

    plan(target, drafter, mb, card, gpus)     every layout at this world size: each rank role's itemised peak,
                                              whether it fits the card, the predicted tokens/s; the best one
                                              (fits, then the most tokens/s)
    largest_fitting_micro_batch(...)          the largest anchors per sequence (then sequences) that fit
    check_training_fits(config, ...)          training's refusal: the layout and micro-batch of a run against
                                              the memory of the visible card(s), before any weight loads

A rank fits when its predicted peak (CUDA context and allocator slack included) is at most the card's
memory; `headroom_gb` keeps a margin for what the model does not see (other processes, NCCL buffers).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from dflash.batching import batching_for
from dflash.config.layout import LAYOUTS, Layout
from dflash.errors import ConfigError, TrainError
from dflash.plan.memory import MicroBatch, RankPeak, pipeline_stages, rank_peaks, worst
from dflash.plan.sizes import DrafterShape, TargetShape
from dflash.plan.throughput import CARDS, Card, tokens_per_second


@dataclass
class Option:
    layout: str
    world: int
    fits: bool
    ranks: list[RankPeak]
    tokens_per_s: float
    step_s: float
    why_not: str = ""
    detail: dict = field(default_factory=dict)

    @property
    def peak_gb(self) -> float:
        return worst(self.ranks).total_gb if self.ranks else float("nan")

    @property
    def label(self) -> str:
        stages = self.detail.get("target_stages")
        return f"{self.layout} ({stages} target stage{'s' if stages > 1 else ''})" if stages else self.layout

    def to_dict(self) -> dict:
        return {"layout": self.layout, "target_stages": self.detail.get("target_stages"), "gpus": self.world,
                "fits": self.fits, "why_not": self.why_not,
                "peak_gb": round(self.peak_gb, 2), "tokens_per_s": round(self.tokens_per_s),
                "step_s": round(self.step_s, 3), "ranks": [r.to_dict() for r in self.ranks]}


def card_from_args(name: str | None, memory_gb: float | None) -> Card:
    """--card NAME, or --card-gb N (a card of that memory with the RTX PRO 6000's speed and links)."""
    if memory_gb is not None and not (math.isfinite(memory_gb) and memory_gb > 0):
        raise ConfigError(f"--card-gb {memory_gb}: a card's memory must be a positive number of GB; pass what "
                          "torch.cuda.mem_get_info reports (a '96 GB' card: about 102)")
    if name:
        key = name.lower()
        if key not in CARDS:
            raise ConfigError(f"--card {name}: unknown card; choose one of {', '.join(CARDS)}, or give its memory "
                              "with --card-gb N")
        card = CARDS[key]
        return card if memory_gb is None else Card(card.name, memory_gb, card.bf16_tflops, card.link_gbps,
                                                   card.host_gbps, card.host_mem_gbps)
    if memory_gb is None:
        raise ConfigError("name the card: --card h200 | rtx-pro-6000 | rtx-5090, or --card-gb N (its memory in GB)")
    base = CARDS["rtx-pro-6000"]
    return Card(f"{memory_gb:g} GB card", memory_gb, base.bf16_tflops, base.link_gbps, base.host_gbps,
                base.host_mem_gbps)


def option(target: TargetShape, drafter: DrafterShape, mb: MicroBatch, layout: str, world: int, card: Card,
           precision: str = "bf16", headroom_gb: float = 0.0, target_stages: int = 0,
           micro_batches: int = 4) -> Option:
    """One layout at this world size on this card. Pipeline with target_stages 0 tries every split of the
    ranks into stages and drafter ranks (at most one stage per target layer) and keeps the fastest that fits
    (else the one with the smallest peak)."""
    staged = Layout.of(layout).target_in_stages
    if staged and target_stages == 0 and world > 1:
        tries = [option(target, drafter, mb, layout, world, card, precision, headroom_gb, s, micro_batches)
                 for s in range(1, min(world, target.layers + 1))]
        fitting = [o for o in tries if o.fits]
        return (max(fitting, key=lambda o: o.tokens_per_s) if fitting
                else min((o for o in tries if o.ranks), key=lambda o: o.peak_gb, default=tries[0]))
    try:
        ranks = rank_peaks(target, drafter, mb, layout, world, precision, target_stages)
    except ConfigError as exc:  # e.g. pipeline on one GPU
        return Option(layout, world, False, [], 0.0, 0.0, why_not=str(exc))
    speed = tokens_per_second(target, drafter, mb, layout, world, card, target_stages, micro_batches)
    peak = worst(ranks)
    fits = peak.total_gb + headroom_gb <= card.memory_gb
    why = "" if fits else f"{peak.role} needs {peak.total_gb:.1f} GB of {card.memory_gb:g}"
    if staged:
        speed["target_stages"] = pipeline_stages(world, target_stages)
    return Option(layout, world, fits, ranks, speed["tokens_per_s"], speed["step_s"], why_not=why, detail=speed)


def fewest_stages(target: TargetShape, drafter: DrafterShape, mb: MicroBatch, card: Card, world: int,
                  **kwargs) -> int | None:
    """The fewest target stage ranks with which --layout pipeline fits `world` cards (None: no split fits)."""
    pipeline = next((name for name in LAYOUTS if Layout.of(name).target_in_stages), None)
    for stages in range(1, min(world, target.layers + 1)):
        if pipeline and option(target, drafter, mb, pipeline, world, card, target_stages=stages, **kwargs).fits:
            return stages
    return None


def plan(target: TargetShape, drafter: DrafterShape, mb: MicroBatch, card: Card, world: int,
         layouts=LAYOUTS, **kwargs) -> tuple[list[Option], Option | None]:
    """(every layout's Option, the best that fits or None)."""
    options = [option(target, drafter, mb, layout, world, card, **kwargs) for layout in layouts]
    fitting = [o for o in options if o.fits]
    return options, max(fitting, key=lambda o: o.tokens_per_s) if fitting else None


def largest_fitting_micro_batch(target: TargetShape, drafter: DrafterShape, mb: MicroBatch, layout: str,
                                world: int, card: Card, **kwargs) -> MicroBatch | None:
    """The micro-batch closest to `mb` that fits under `layout`: fewer anchors per sequence (halving, down
    to 1), then fewer sequences; None when not even 1 sequence with 1 anchor fits."""
    for batch in range(mb.batch, 0, -1):
        anchors = mb.anchors
        while anchors >= 1:
            trial = MicroBatch(batch, mb.seq_len, anchors)
            if option(target, drafter, trial, layout, world, card, **kwargs).fits:
                return trial
            anchors //= 2
    return None


def best_fitting(target: TargetShape, drafter: DrafterShape, mb: MicroBatch, card: Card, world: int,
                 **kwargs) -> tuple[MicroBatch, Option] | None:
    """The micro-batch closest to `mb` that some layout fits (fewer anchors per sequence, halving down to 1,
    then fewer sequences) with the best layout for it; None when nothing fits."""
    for batch in range(mb.batch, 0, -1):
        anchors = mb.anchors
        while anchors >= 1:
            trial = MicroBatch(batch, mb.seq_len, anchors)
            _, best = plan(target, drafter, trial, card, world, **kwargs)
            if best:
                return trial, best
            anchors //= 2
    return None


# --------------------------------------------------------------------------------------------------
# training's refusal
# --------------------------------------------------------------------------------------------------
def visible_card_gb(device) -> float | None:
    """What this process may use on its GPU (GB): the card's memory x the per-process memory fraction
    (torch.cuda.set_per_process_memory_fraction), at most what is free now; None off a GPU."""
    import torch

    if getattr(device, "type", "cpu") != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    fraction = getattr(torch.cuda.memory, "get_per_process_memory_fraction", None)
    allowed = total * (fraction(index) if fraction else 1.0)
    return min(allowed, free + torch.cuda.memory_reserved(index)) / 1e9


def run_shapes(config, target_path) -> tuple[TargetShape, DrafterShape, MicroBatch]:
    """The target, drafter and per-rank micro-batch of a training run, from its config alone."""
    from dflash.plan.sizes import drafter_shape, target_shape_from_dir

    target = target_shape_from_dir(target_path)
    model = config.model
    drafter = drafter_shape(target, layers=model.drafter_layers, block_size=model.block_size,
                            tapped=len(model.target_layer_ids) if model.target_layer_ids else None,
                            sliding_window=model.sliding_window, kind=model.drafter_kind,
                            recompute=config.runtime.recompute_layers)
    return target, drafter, MicroBatch(batch=1, seq_len=model.max_length, anchors=model.max_anchors)


def stacked(drafters: list[DrafterShape]) -> DrafterShape:
    """Several drafters trained on one target pass, as the memory model sees them: their states add up (weights,
    gradients, AdamW moments: the parameters summed), one runs at a time (its activations, the largest drafter's
    layers, block, taps and FSDP unit)."""
    largest = max(drafters, key=lambda dr: dr.params)
    return DrafterShape(layers=max(dr.layers for dr in drafters), hidden=largest.hidden,
                        tapped=max(dr.tapped for dr in drafters), block_size=max(dr.block_size for dr in drafters),
                        params=sum(dr.params for dr in drafters), unit_params=max(dr.unit_params for dr in drafters),
                        config=largest.config, layer_surplus=max(dr.layer_surplus for dr in drafters),
                        recomputed=min(dr.recomputed for dr in drafters))


def fewest_recomputed_layers(target: TargetShape, drafter: DrafterShape, mb: MicroBatch, layout: str, world: int,
                             card: Card, precision: str = "bf16", target_stages: int = 0) -> int | None:
    """The fewest drafter layers recomputed in the backward (--recompute-layers) with which `mb` fits under
    `layout`, more than the drafter recomputes now; None if recomputing every layer does not make it fit."""
    for r in range(drafter.recomputed + 1, drafter.layers + 1):
        trial = dataclasses.replace(drafter, recomputed=r)
        if option(target, trial, mb, layout, world, card, precision=precision, target_stages=target_stages).fits:
            return r
    return None


def worst_micro_batches(batching, world: int) -> list[MicroBatch]:
    """The per-rank micro-batches check_training_fits checks: those the run's batching can form at their
    largest (dflash.batching.base.Batching.worst_shapes: one packed row; the worse two of padded batches)."""
    return [MicroBatch(*shape) for shape in batching.worst_shapes(world)]


def check_training_fits(config, world: int, card_gb: float | None, layout: str | None = None,
                        batching=None, drafters: list[DrafterShape] | None = None) -> None:
    """Refuse (TrainError) a run whose layout the memory model says will not fit `card_gb` per rank, naming
    the layout and micro-batch that would. `card_gb` None (a CPU run) or --no-memory-check: no check.

    The micro-batches checked are the largest the run's `batching` can form (worst_micro_batches; None: the
    one --packing names, 'auto' as on a CPU).
    `drafters`: the shapes of several drafters on one target pass (dflash.train.multi), checked `stacked`.
    """
    from pathlib import Path

    layout = layout or config.runtime.layout
    batching = batching or batching_for(config, "cpu")
    if card_gb is None or not getattr(config.runtime, "memory_check", True):
        return
    target_path = config.io.target
    if not target_path or not (Path(target_path) / "config.json").is_file():
        return  # the demo, a Hub id: the shape is only known once loaded
    target, drafter, _longest = run_shapes(config, target_path)
    if drafters:
        drafter = stacked(drafters)
    card = Card(f"{card_gb:.1f} GB visible", card_gb, CARDS["h200"].bf16_tflops, CARDS["h200"].link_gbps)
    precision = "fp32" if config.runtime.precision == "fp32" else "bf16"
    # the run's split (--target-stages, 0: half the ranks), never the search `option` makes for target_stages 0
    stages = pipeline_stages(world, config.runtime.target_stages) if Layout.of(layout).target_in_stages else 0
    checked = [(mb, option(target, drafter, mb, layout, world, card, precision=precision, target_stages=stages))
               for mb in worst_micro_batches(batching, world)]
    mb, chosen = next(((m, o) for m, o in checked if not o.fits), checked[0])
    if chosen.fits:
        return
    peak = worst(chosen.ranks) if chosen.ranks else None
    where = "per rank" if peak and peak.role == "every rank" else f"on the {peak.role if peak else ''}"
    need = (f"needs {peak.total_gb:.1f} GB {where} (" +
            ", ".join(f"{k} {v:.1f}" for k, v in peak.terms.items() if v >= 0.05) + ")") if peak else chosen.why_not
    hints = ["train fewer drafters per run, or smaller ones (--drafter-layers)"] if drafters and len(drafters) > 1 else []
    smaller = largest_fitting_micro_batch(target, drafter, mb, layout, world, card, precision=precision,
                                          target_stages=stages) if chosen.ranks else None
    recompute = fewest_recomputed_layers(target, drafter, mb, layout, world, card, precision, stages) \
        if chosen.ranks else None
    if recompute:
        hints.append(f"--recompute-layers {recompute} (the same training, one more forward of {recompute} drafter "
                     "layers a step)")
    if smaller:
        hints.append(f"--layout {layout} with {batching.smaller(smaller.batch, smaller.anchors, world)}")
    others = [o for o in plan(target, drafter, mb, card, world, precision=precision)[0] if o.fits and o.layout != layout]
    if others:
        best = max(others, key=lambda o: o.tokens_per_s)
        split = f" --target-stages {best.detail['target_stages']}" if Layout.of(best.layout).target_in_stages else ""
        hints.append(f"--layout {best.layout}{split} fits this micro-batch ({best.peak_gb:.1f} GB per rank)")
    if not hints:
        hints.append(f"no layout fits {world} card(s) of {card_gb:.1f} GB; use more GPUs (dflash plan --target "
                     f"{target_path} --card-gb {card_gb:.0f} --gpus N shows what fits)")
    what = f"{len(drafters)} drafters on one target pass with " if drafters and len(drafters) > 1 else ""
    raise TrainError(f"--layout {layout} will not fit: {what}a micro-batch of {mb.describe()} {need}, and this process "
                     f"may use {card_gb:.1f} GB. " + "; or ".join(hints) +
                     ". Pass --no-memory-check to start anyway.")
