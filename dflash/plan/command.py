"""`dflash plan`: which --layout fits a card, each rank's itemised peak and the predicted tokens/s.

    dflash plan --target 27b --card rtx-pro-6000 --gpus 1
    dflash plan --target /models/Qwen3.5-27B --card-gb 32 --gpus 8 --batch-size 2 --seq-len 4096 --anchors 512
    dflash plan --target 27b --table          the cards x (1, 2, 8) GPUs table of docs/memory.md
    dflash plan ... --json                    the same as JSON, for tools
"""

from __future__ import annotations

import argparse
import json
import math

from common.cli import DefaultsOnceHelpFormatter, add_version

from dflash import kinds
from dflash.errors import ConfigError
from dflash.config.layout import LAYOUTS, Layout
from dflash.plan.memory import PRECISIONS, MicroBatch
from dflash.plan.planner import best_fitting, card_from_args, fewest_stages, plan
from dflash.plan.sizes import PRESETS, TARGET_PRECISIONS, context_length, drafter_shape, target_shape
from dflash.plan.throughput import (CARDS, GPUS_PER_NODE, NETWORK_GBPS, STEP_LATENCY_S, communication_note,
                                    ring_gbps)

TABLE_GPUS = (1, 2, 8)


def plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash plan", formatter_class=DefaultsOnceHelpFormatter,
                                description="Which --layout fits a card: each rank's predicted peak memory, item by "
                                            "item, and the predicted tokens/s (docs/memory.md).")
    p.add_argument("--target", required=True, help=f"a local model directory (its config.json is read, no weights) "
                   f"or a preset: {', '.join(PRESETS)}")
    p.add_argument("--target-precision", choices=TARGET_PRECISIONS, default="auto",
                   help="the target's weights: fp8 (an FP8 block-quantised release: 1 byte per weight + block scales), "
                   "bf16, or auto (a model directory's config.json quantization_config says; a preset is bf16)")
    p.add_argument("--card", help=f"a named card: {', '.join(CARDS)}")
    p.add_argument("--card-gb", type=float, help="the card's memory in GB of 10^9 bytes, as torch.cuda.mem_get_info "
                   "reports it (a '96 GB' card: about 102); with --card: overrides its memory")
    p.add_argument("--gpus", type=int, default=1, help="GPUs (processes) in the run")
    p.add_argument("--layout", choices=LAYOUTS, help="only this layout (default: every one)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per micro-batch per rank")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--anchors", type=int, default=512, help="anchors (blocks) per sequence")
    p.add_argument("--pack-tokens", type=int, default=0, help="a packed run (dflash-train --packing on, the GPU "
                   "default): one row of this many tokens per rank, instead of --batch-size x --seq-len")
    p.add_argument("--pack-anchors", type=int, default=1024, help="with --pack-tokens: anchors per packed row")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--drafter-kind", choices=kinds.names(), default=kinds.DEFAULT,
                   help="the drafter generation (dflash-train --drafter-kind)")
    p.add_argument("--sliding-window", type=int, default=0)
    p.add_argument("--recompute-layers", type=int, default=0, help="drafter layers that recompute their "
                   "activations in the backward (dflash-train --recompute-layers)")
    p.add_argument("--precision", choices=tuple(PRECISIONS), default="bf16")
    p.add_argument("--target-stages", type=int, default=0, help="--layout pipeline: stage ranks (0: every split tried)")
    p.add_argument("--micro-batches", type=int, default=4, help="--layout pipeline: micro-batches per step in flight")
    p.add_argument("--headroom-gb", type=float, default=0.0, help="memory to leave free on each card")
    p.add_argument("--table", action="store_true", help=f"every named card x {', '.join(map(str, TABLE_GPUS))} GPUs: "
                   "the best layout of each (Markdown)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_version(p)
    return p


# Each whole-number flag's least value and what it counts: a refusal names the flag, the value and both.
AT_LEAST = {
    "gpus": (1, "the GPUs (processes) in the run"),
    "batch_size": (1, "the sequences per micro-batch per rank"),
    "seq_len": (2, "the tokens per sequence"),
    "anchors": (1, "the anchors (blocks) per sequence"),
    "block_size": (2, "the tokens per block (its anchor and those drafted after it)"),
    "drafter_layers": (1, "the drafter's decoder layers"),
    "sliding_window": (0, "the sliding window (0: every drafter layer attends to the whole context)"),
    "target_stages": (0, "the stage ranks of --layout pipeline (0: every split tried)"),
    "micro_batches": (1, "the micro-batches in flight per step of --layout pipeline"),
}


def _check(args) -> None:
    """Refuse nonsense flags by name before any work (no target is read, no model built)."""
    defaults = plan_parser()
    for name, (least, what) in AT_LEAST.items():
        value = getattr(args, name)
        if value < least:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} {value}: {what} must be at least {least}; pass {flag} {least} or more "
                              f"(default {defaults.get_default(name)})")
    if args.pack_tokens and not args.pack_tokens >= 2 * args.block_size:
        raise ConfigError(f"--pack-tokens {args.pack_tokens}: a packed row needs at least 2 x --block-size tokens; "
                          "pass the run's --pack-tokens (8192 by default)")
    if args.pack_tokens and not 1 <= args.pack_anchors <= args.pack_tokens // 2:
        raise ConfigError(f"--pack-anchors {args.pack_anchors} with --pack-tokens {args.pack_tokens}: pass 1 to "
                          f"{args.pack_tokens // 2} (anchors sit in the supervised tokens)")
    if args.anchors > args.seq_len // 2:
        raise ConfigError(f"--anchors {args.anchors} with --seq-len {args.seq_len}: anchors sit in the supervised "
                          f"tokens, at most about half of a sequence; use --anchors {args.seq_len // 2} or fewer")
    if args.layout and not args.table and args.gpus < Layout.of(args.layout).min_world:
        others = ", ".join(name for name in LAYOUTS if Layout.of(name).min_world <= args.gpus)
        raise ConfigError(f"--layout {args.layout} with --gpus {args.gpus}: it splits the target's layers over stage "
                          f"ranks and trains the drafter on other ranks, so it needs --gpus "
                          f"{Layout.of(args.layout).min_world} or more; pass more --gpus, or another --layout "
                          f"({others}; or leave --layout out to see every one)")
    if args.target_stages and not args.table and args.target_stages >= args.gpus:
        fix = (f"pass --target-stages {args.gpus - 1} or fewer (0 tries every split)" if args.gpus > 1
               else "leave --target-stages out (--layout pipeline needs --gpus 2 or more)")
        raise ConfigError(f"--target-stages {args.target_stages} with --gpus {args.gpus}: --layout pipeline needs a "
                          f"drafter rank beside its stage ranks; {fix}")
    if not (math.isfinite(args.headroom_gb) and args.headroom_gb >= 0):
        raise ConfigError(f"--headroom-gb {args.headroom_gb}: the memory to leave free on each card must be 0 or "
                          "more GB; pass --headroom-gb 0 (the default) or a few GB")
    if not args.table and not args.card and args.card_gb is None:
        raise ConfigError("name the card: --card h200 | rtx-pro-6000 | rtx-5090, or --card-gb N (its memory in GB); "
                          "or --table for every named card")


def _check_context(args) -> None:
    """Refuse a --seq-len longer than the target's context (max_position_embeddings), read from its config.json
    or the preset before the target is built. A packed row (--pack-tokens) holds several sequences, each with
    its own positions, so only --seq-len is checked."""
    limit = context_length(args.target)
    if limit is not None and not args.pack_tokens and args.seq_len > limit:
        where = (f"the {args.target} preset" if args.target in PRESETS else f"{args.target}'s config.json")
        raise ConfigError(f"--seq-len {args.seq_len}: the target reads at most {limit:,} positions "
                          f"(max_position_embeddings of {where}), so no sequence of a run is that long; pass "
                          f"--seq-len {limit} or less (the run's --max-length)")


def _communication(card, gpus: int) -> dict | None:
    """The links a multi-GPU prediction assumed (dflash.plan.throughput), for --json."""
    if gpus <= 1:
        return None
    return {"gpus_per_node": GPUS_PER_NODE, "link_gbps": card.link_gbps, "network_gbps": NETWORK_GBPS,
            "ring_gbps": ring_gbps(card, gpus), "step_latency_s": STEP_LATENCY_S, "measured": False,
            "upper_bound": gpus > GPUS_PER_NODE, "note": communication_note(card, gpus)}


def _rank_lines(o) -> list[str]:
    lines = []
    for r in o.ranks:
        items = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in r.terms.items() if v >= 0.05)
        host = f"; host memory {r.host_gb:.1f} GB" if r.host_gb else ""
        lines.append(f"    {r.role}: {r.total_gb:.1f} GB at the {r.moment} ({items}){host}")
    return lines


def _text(target, drafter, mb, card, gpus, options, best) -> str:
    kind = "FP8, 128 x 128 blocks" if target.fp8 else "bf16"
    out = [f"target {target.name}: {target.params / 1e9:.2f} B parameters ({target.weight_bytes(2) / 1e9:.1f} GB, {kind}), "
           f"{target.layers} layers, hidden {target.hidden}, vocabulary {target.vocab}; drafter {drafter.layers} layers, {drafter.params / 1e9:.2f} B parameters, "
           f"block {drafter.block_size}",
           f"micro-batch per rank: {mb.describe()}; {gpus} x {card.name} ({card.memory_gb:g} GB usable)", ""]
    for o in options:
        if not o.ranks:
            out.append(f"{o.layout:<10} -  {o.why_not}")
            continue
        verdict = "fits" if o.fits else "does not fit"
        out.append(f"{o.label:<10} {verdict}: peak {o.peak_gb:.1f} GB per rank, predicted {o.tokens_per_s:,.0f} tokens/s")
        out += _rank_lines(o)
    out.append("")
    out.append(f"best: --layout {best.label} ({best.tokens_per_s:,.0f} tokens/s, {best.peak_gb:.1f} GB per rank)"
               if best else "nothing fits: more GPUs, a larger card, or a smaller micro-batch")
    return "\n".join(out)


def _table(target, drafter, mb, args) -> tuple[str, list[dict]]:
    """Every named card x TABLE_GPUS: the best layout for the micro-batch, or for the largest one that fits."""
    rows = []
    lines = ["| card (GB usable) | GPUs | micro-batch per rank | layout | per-rank peak | predicted tokens/s |",
             "|---|---|---|---|---|---|"]
    for key, card in CARDS.items():
        for gpus in TABLE_GPUS:
            found = best_fitting(target, drafter, mb, card, gpus, precision=args.precision,
                                 headroom_gb=args.headroom_gb, target_stages=args.target_stages,
                                 micro_batches=args.micro_batches)
            rows.append({"card": key, "gpus": gpus, "micro_batch": vars(found[0]) if found else None,
                         "best": found[1].to_dict() if found else None})
            name = f"{card.name} ({card.memory_gb:g})"
            if found:
                fit_mb, best = found
                lines.append(f"| {name} | {gpus} | {fit_mb.describe()} | {best.label} | {best.peak_gb:.1f} GB | "
                             f"{best.tokens_per_s:,.0f} |")
            else:
                lines.append(f"| {name} | {gpus} | none fits | - | - | - |")
    return "\n".join(lines), rows


def main(argv) -> int:
    args = plan_parser().parse_args(argv)
    _check(args)
    _check_context(args)
    card = card_from_args(args.card, args.card_gb) if args.card or args.card_gb is not None else None
    if card and args.headroom_gb >= card.memory_gb:
        raise ConfigError(f"--headroom-gb {args.headroom_gb:g} leaves nothing of the {card.memory_gb:g} GB of "
                          f"{card.name}; pass less than {card.memory_gb:g}")
    target = target_shape(args.target, precision=args.target_precision)
    drafter = drafter_shape(target, layers=args.drafter_layers, block_size=args.block_size,
                            sliding_window=args.sliding_window, kind=args.drafter_kind, recompute=args.recompute_layers)
    mb = (MicroBatch(1, args.pack_tokens, args.pack_anchors) if args.pack_tokens else
          MicroBatch(args.batch_size, args.seq_len, args.anchors))
    if args.table:
        text, rows = _table(target, drafter, mb, args)
        print(json.dumps({"micro_batch": vars(mb), "rows": rows}, indent=2) if args.json else text)
        return 0
    layouts = (args.layout,) if args.layout else LAYOUTS
    options, best = plan(target, drafter, mb, card, args.gpus, layouts=layouts, precision=args.precision,
                         headroom_gb=args.headroom_gb, target_stages=args.target_stages,
                         micro_batches=args.micro_batches)
    if args.json:
        print(json.dumps({"target": target.name, "target_params": target.params,
                          "target_precision": "fp8" if target.fp8 else "bf16",
                          "target_weight_bytes": target.weight_bytes(2), "drafter_params": drafter.params,
                          "micro_batch": vars(mb), "card": vars(card), "gpus": args.gpus,
                          "communication": _communication(card, args.gpus),
                          "options": [o.to_dict() for o in options], "best": best.layout if best else None},
                         indent=2))
    else:
        print(_text(target, drafter, mb, card, args.gpus, options, best))
        if any(o.detail.get("target_stages") for o in options):
            least = fewest_stages(target, drafter, mb, card, args.gpus, precision=args.precision,
                                  headroom_gb=args.headroom_gb, micro_batches=args.micro_batches)
            print(f"--layout pipeline: the fewest target stages that fit are {least} of {args.gpus} GPUs "
                  f"({'FP8' if target.fp8 else 'bf16'} target)" if least else
                  f"--layout pipeline: no split of {args.gpus} GPUs fits")
        if args.gpus > 1:  # what the multi-GPU tokens/s assumed of the links, and how far to trust it
            print(communication_note(card, args.gpus))
    return 0 if best else 1
