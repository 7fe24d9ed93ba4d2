"""Training on a mix of sequence lengths: padded length-bucketed batches against packed rows, side by side.

    python bench/bench_length_mix.py                                  CPU, toy size (a tiny random hybrid)
    python bench/bench_length_mix.py --preset 27b --json out.json     one H200: Qwen3.5-27B's shape
    python bench/bench_length_mix.py --data lengths.txt               the lengths of a real file
    python bench/bench_length_mix.py --preset 27b --fp8-target        an FP8 target (the 27B shape on an 80 GB card)
    (also: python bench/bench_train.py --lengths chat|FILE ...)

The sequences: --lengths-from chat (default) draws a seeded chat-like mix, log-normal lengths with a median
of about 1.5k tokens clipped to 256..--max-length (4096; a shorter --max-length scales the mix) (what length-bucketed real chat data gives); --data FILE
takes them from a file: one length per line, or a chat JSONL ({"messages": [...]}) tokenised with the chat
template of --tokenizer DIR. Tokens are random ids (speed does not depend on them); the first third of each
sequence is the prompt (loss mask 0), the rest the answer.

Every variant runs the real training loop (`dflash.train.trainer.train`), one after the other in one run:
    fixed    the fixed shape bench_train measures: --batch-size sequences of --max-length tokens each (the first
             third prompt, as in the mix), --anchors anchors per sequence; the yardstick the packed run is held to
    padded   the mix, --packing off, --batch-size sequences per micro-batch, at most --max-tokens padded tokens
    packed   the mix, --packing on, one row of --pack-tokens tokens with --pack-anchors anchors per micro-batch
and each reports: useful tokens/s (real tokens only, after --warmup steps), graphs compiled after the first
step (recompiles: a packed run has none), median and max step time after warm-up, and peak GPU memory.
On a GPU each variant runs in a child process of its own (--processes each): nothing one leaves behind
(compiled graphs, the caching allocator's blocks, a failed variant's frames) reaches the next. In one
process the 27B packed variant's first step, after the fixed variant, ran past four minutes against about
one alone (bench/results/h200/length-mix-27b-run3-cut.log). A child is stopped once its last step ends and its
row is written: the trainer's end-of-run checkpoint (about 45 s at the 27B shape) is not measured, and a run cut
off by a time limit keeps every row written before (--json is rewritten as each variant ends).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "bench"))  # memory_phases, beside this file

from common.cmd import kill_group  # noqa: E402
from dflash.config import TrainConfig  # noqa: E402
from dflash.kinds import DEFAULT, names  # noqa: E402
from dflash.model.fp8 import pick_gemm, quantize_model, use_fp8_gemm  # noqa: E402
from dflash.model.fp8_checkpoint import default_modules_to_not_convert  # noqa: E402
from dflash.model.shapes import QWEN35_27B, random_target, scaled_qwen35_shape  # noqa: E402
from dflash.train.probes.timing import free_memory, matmul_peak, sync  # noqa: E402
from dflash.train.trainer import train  # noqa: E402


def chat_mix(n: int, seed: int, longest: int, median: int = 1500, shortest: int = 256) -> list[int]:
    """`n` chat-like lengths: log-normal around `median` (sigma 0.6), clipped to shortest..longest; below a
    `longest` of 4096 both ends scale with it (a toy run keeps the mix's shape)."""
    if longest < 4096:
        median, shortest = max(2, median * longest // 4096), max(2, shortest * longest // 4096)
    rng = random.Random(seed)
    return [min(longest, max(shortest, int(rng.lognormvariate(math.log(median), 0.6)))) for _ in range(n)]


def lengths_from_file(path: Path, tokenizer: str | None, longest: int) -> list[int]:
    """Lengths read from `path`: integers one per line, or a chat JSONL tokenised with `tokenizer`'s template
    (truncated to `longest`, as training truncates)."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if all(line.strip().isdigit() for line in lines):
        return [min(longest, int(line)) for line in lines]
    if not tokenizer:
        raise SystemExit(f"{path} is not one length per line; a chat JSONL needs --tokenizer DIR (its chat template)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    return [min(longest, len(tok.apply_chat_template(json.loads(line)["messages"], tokenize=True)))
            for line in lines]


def items_of(lengths: list[int], vocab: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    items = []
    for n in lengths:
        mask = torch.zeros(n, dtype=torch.long)
        mask[n // 3:] = 1
        items.append({"input_ids": torch.randint(3, vocab, (n,), generator=g), "loss_mask": mask})
    return items


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run_variant(target, items: list[dict], args, variant: str, device: torch.device,
                on_row: Callable[[dict], None] | None = None) -> dict:
    """One training run of `args.steps + args.warmup` steps; per-step times and the figures above. `on_row`
    gets the row as soon as the last step ends, before the trainer writes its end-of-run checkpoint (the
    drafter and its AdamW state: about 20 GiB and 45 s at the 27B shape, which the benchmark does not measure)."""
    packed = variant == "packed"
    stamps, graphs, peaks, row = [], [], [], {}
    flops = record_step_flops(target)

    def on_step(step, m):
        sync(device)
        stamps.append((time.perf_counter(), m["tokens"]))
        graphs.append(graphs_compiled())
        peaks.append(m.get("gpu_mem_gib", 0.0))  # the step's peak: the trainer resets the counter every step
        took = stamps[-1][0] - (stamps[-2][0] if len(stamps) > 1 else start)
        print(f"{variant}: step {len(stamps)} took {took:.3f} s, {m['tokens']} tokens", file=sys.stderr, flush=True)
        if len(stamps) == args.steps + args.warmup:
            row.update(step_figures(variant, start, stamps, graphs, peaks if device.type == "cuda" else [], args.warmup))
            row.update(physical_limit(row, flops, args), without=args.without)
            if PHASES:
                row.update(PHASES[-1].summary())
            if on_row:
                on_row(row)
        return False

    batching = (dict(packing="on", pack_tokens=args.pack_tokens, pack_anchors=args.pack_anchors) if packed else
                dict(packing="off", batch_size=args.batch_size, max_tokens=args.max_tokens, max_anchors=args.anchors))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        if args.memory_phases or args.memory_snapshot:
            from memory_phases import PhaseMemory

            PHASES.append(PhaseMemory(device, args.memory_phases or 1, args.memory_snapshot).install(target))
    with tempfile.TemporaryDirectory(prefix="bench-mix-", dir=args.work_dir) as out:
        cfg = TrainConfig.from_flat(out=out, block_size=args.block_size, drafter_layers=args.drafter_layers,
                                    max_length=args.max_length, max_steps=args.steps + args.warmup, epochs=0,
                                    save_every=0, log_every=10**6, progress=False, device=str(device),
                                    memory_check=False, drafter_kind=args.kind,
                                    recompute_layers=args.recompute_layers, **batching)
        start = time.perf_counter()  # on_step reads it: the first step's time runs from here
        train(cfg, target=target, items=items, on_step=on_step, handle_signals=False)
    return row or step_figures(variant, start, stamps, graphs, peaks if device.type == "cuda" else [], args.warmup)


PHASES: list = []  # the memory_phases.PhaseMemory of the variant running (--memory-phases)
LEVERS = ("norms", "bounds", "mlp")


def undo_levers(names: list[str]) -> None:
    """Put back the code before these step changes, for before/after rows in one run (bench/NOTES.md):
    norms   the target's RMSNorms eager (dflash.model.fused_norms not applied)
    bounds  a fresh int64 cu_seqlens in every GatedDeltaNet layer (dflash.model.segment_kernels.long_bounds)
    mlp     the target MLPs' SiLU, product and down-projection quantisation eager (dflash.model.fused_mlp)"""
    unknown = sorted(set(names) - set(LEVERS))
    if unknown:
        raise SystemExit(f"--without {','.join(unknown)}: choose from {', '.join(LEVERS)}")
    if "norms" in names:
        import dflash.model.target as target_module

        target_module.compile_norms = lambda model: 0
    if "bounds" in names:
        import dflash.model.segment_kernels as segment_kernels

        segment_kernels.long_bounds = lambda cu_seqlens: cu_seqlens.to(torch.long)
    if "mlp" in names:
        import dflash.model.target as target_module

        target_module.fuse_mlps = lambda model: 0


def record_step_flops(target) -> list[tuple[float, float]]:
    """Every micro-batch's model FLOPs as the trainer's MFU counter sees them, split into (target forward over
    the layers a training pass runs, drafter + LM head): a list that fills as training runs."""
    from dflash.model.flops import target_forward_flops
    from dflash.train.probes import mfu

    seen: list[tuple[float, float]] = []
    ran = (max(target.layer_ids) + 1) / target.num_layers  # the pass ends after the last tapped layer

    def count(self, items, anchors):
        lengths = [int(it["input_ids"].numel()) for it in items]
        t, d = target_forward_flops(self.target, lengths) * ran, sum(mfu.drafter_and_head_flops(self.dcfg, items, anchors))
        seen.append((t, d))
        return t / ran + d

    mfu.StepFlops.__call__ = count
    return seen


def physical_limit(row: dict, flops: list[tuple[float, float]], args) -> dict:
    """The step's model FLOPs at the bf16 matmul peak measured in this run (the target's at twice it with an
    FP8 target): the fastest step the card allows, as tokens/s, and the share of it the loop reaches."""
    peak = getattr(args, "matmul_peak", None)
    if not peak or not flops:
        return {}
    steps = flops[args.warmup:] or flops
    target_tf = statistics.mean(t for t, _ in steps) / 1e12
    drafter_tf = statistics.mean(d for _, d in steps) / 1e12
    floor_s = target_tf / (peak * (2 if args.fp8_target else 1)) + drafter_tf / peak
    tokens = statistics.mean(row["tokens_per_step"][args.warmup:] or row["tokens_per_step"])
    return {"card": torch.cuda.get_device_name(), "matmul_peak_tflops": round(peak, 1), "target_tflop_per_step": round(target_tf, 1),
            "drafter_head_tflop_per_step": round(drafter_tf, 1), "limit_tokens_per_s": round(tokens / floor_s),
            "fraction_of_limit": round(row["useful_tokens_per_s"] * floor_s / tokens, 4)}


def step_figures(variant: str, start: float, stamps: list[tuple[float, int]], graphs: list[int], peaks: list[float],
                 warmup: int) -> dict:
    """A variant's row from its steps' (end time, tokens), graph counts and GPU peaks (none on a CPU)."""
    times = [b[0] - a[0] for a, b in zip([(start, 0)] + stamps, stamps)]
    timed, tokens = times[warmup:], [t for _, t in stamps[warmup:]]
    row = {"variant": variant, "steps": len(stamps),
           "useful_tokens_per_s": sum(tokens) / sum(timed), "median_step_s": statistics.median(timed),
           "max_step_s": max(timed), "first_step_s": times[0],
           "recompiles_after_first_step": graphs[-1] - graphs[0] if graphs else 0,
           "step_seconds": [round(t, 4) for t in times], "tokens_per_step": [t for _, t in stamps]}
    if peaks:  # the largest step peak (max_memory_allocated after training would be the last step's tail)
        row["peak_memory_gib"] = max(peaks)
    return row


def report(rows: list[dict], fixed: float | None) -> str:
    w = max([7] + [len(r["variant"]) for r in rows])
    lines = [f"{'variant':<{w}} {'useful tok/s':>12} {'recompiles':>10} {'median s':>9} {'max s':>8} {'max/med':>8} "
             f"{'peak GiB':>9}"]
    for r in rows:
        peak = f"{r['peak_memory_gib']:.1f}" if "peak_memory_gib" in r else "-"
        lines.append(f"{r['variant']:<{w}} {r['useful_tokens_per_s']:>12.0f} {r['recompiles_after_first_step']:>10} "
                     f"{r['median_step_s']:>9.3f} {r['max_step_s']:>8.3f} {r['max_step_s'] / r['median_step_s']:>8.2f} "
                     f"{peak:>9}")
    for r in rows:
        if "fraction_of_limit" in r:
            lines.append(f"{r['variant']}: {r['target_tflop_per_step'] + r['drafter_head_tflop_per_step']:.0f} TFLOP a step "
                         f"(target {r['target_tflop_per_step']:.0f}), bf16 matmul peak {r['matmul_peak_tflops']:.0f} TFLOP/s: "
                         f"limit {r['limit_tokens_per_s']} tokens/s, reached {r['fraction_of_limit']:.1%}")
    by = {r["variant"]: r for r in rows}
    if {"padded", "packed"} <= by.keys():
        lines.append(f"packed / padded useful tokens/s: "
                     f"{by['packed']['useful_tokens_per_s'] / by['padded']['useful_tokens_per_s']:.2f}x")
    fixed = by["fixed"]["useful_tokens_per_s"] if "fixed" in by else fixed
    for variant in ("padded", "packed"):
        if fixed and variant in by:
            lines.append(f"{variant} / the fixed-shape figure ({fixed:.0f} tokens/s): "
                         f"{by[variant]['useful_tokens_per_s'] / fixed:.2f}x")
    return "\n".join(lines)


def without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """`argv` less each of `flags` and its value (`--flag value` or `--flag=value`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in flags)):
            out.append(a)
    return out


def wait_for_gpu_memory(limit_mib: int = 2048, timeout: float = 60.0) -> None:
    """Wait until the GPU's used memory is under `limit_mib` (nvidia-smi), at most `timeout` seconds: a
    stopped child's memory is released some seconds after it is gone, and a variant started at once ran out
    of memory at the 27B shape beside it (bench/NOTES.md). Returns at once where nvidia-smi is missing."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout
            if max(int(x) for x in out.split()) < limit_mib:
                return
        except (OSError, ValueError, subprocess.SubprocessError):
            return
        time.sleep(1)


def run_in_child(argv: list[str], variant: str) -> dict:
    """One variant in a child process of its own (this script, the same flags); its row, or its failure. The
    child writes its row when its last step ends; it is then stopped with every process it started (inductor's
    compile workers), so the trainer's end-of-run checkpoint (not measured) costs no time, and its run directory,
    made in this process's temporary folder, goes with it."""
    with tempfile.TemporaryDirectory(prefix="bench-mix-row-") as tmp:
        rows = Path(tmp) / "rows.json"
        cmd = [sys.executable, str(Path(__file__).resolve()),
               *without(argv, ("--variants", "--json", "--processes", "--work-dir")),
               "--variants", variant, "--processes", "one", "--json", str(rows), "--work-dir", tmp]
        child = subprocess.Popen(cmd, start_new_session=True)  # its compile workers in its session
        try:
            while child.poll() is None and not rows.exists():
                time.sleep(0.5)
        finally:  # the row is in, or an exception here (SIGTERM below): the child and its workers go first
            kill_group(child, grace=30)
            wait_for_gpu_memory()
        if rows.exists():
            return json.loads(rows.read_text())["rows"][0]
        return {"variant": variant, "error": f"its process ended with exit status {child.returncode} and no row"}


def run_here(args, variants: list[str], lengths: list[int], shape: dict, device: torch.device,
             save: Callable[[list[dict]], None]) -> list[dict]:
    """Every variant in this process, one target for all; `save` gets the rows so far each time one is done
    (the row of a variant as soon as its last step ends)."""
    undo_levers([n for n in args.without.split(",") if n])
    if device.type == "cuda":  # measured before the target takes the memory, in the process that trains
        args.matmul_peak = matmul_peak(device)
        print(json.dumps({"card": torch.cuda.get_device_name(device), "matmul_peak_tflops": round(args.matmul_peak, 1)}),
              flush=True)
    target = random_target(shape, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.fp8_target:  # as an FP8 checkpoint loads: 128 x 128 block-scaled weights, the GEMM for this device
        layers = quantize_model(target.model, default_modules_to_not_convert(target.model))
        use_fp8_gemm(target.model, pick_gemm(device))
        free_memory(device)
        print(json.dumps({"fp8_layers": layers, "gemm": pick_gemm(device)}), flush=True)
    mix = items_of(lengths, target.vocab_size, args.seed)
    rows = []
    for variant in variants:
        items = mix if variant != "fixed" else items_of([args.max_length] * len(lengths), target.vocab_size, args.seed)
        try:
            rows.append(run_variant(target, items, args, variant, device, on_row=lambda row: save(rows + [row])))
        except Exception as e:  # one failing variant must not lose the other's figures
            rows.append({"variant": variant, "error": f"{type(e).__name__}: {str(e)[:2000]}",
                         **(PHASES[-1].summary() if PHASES else {})})
        # Outside the except block: a failed variant's frames (its drafter, optimizer state, activations) are
        # released only with its exception. Freed inside it, the next variant started with them still held and
        # ran out of memory (bench/results/h200/length-mix-27b-run1.log). Each variant compiles afresh.
        free_memory(device)
        torch._dynamo.reset()
        save(rows)
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default=None, help="27b (Qwen3.5-27B's shape) or large (--hidden/--layers/--vocab); "
                   "default: large on a CPU at toy size, 27b on a GPU")
    p.add_argument("--variants", default="padded,packed", help="any of fixed, padded, packed, in the order to run")
    p.add_argument("--kind", default=DEFAULT, choices=names())
    p.add_argument("--data", type=Path, help="take the lengths from this file (module docstring)")
    p.add_argument("--tokenizer", help="a model directory whose chat template tokenises a chat JSONL --data")
    p.add_argument("--sequences", type=int, default=None, help="sequences of the chat-like mix (default 4000 GPU, 24 CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 40 GPU, 3 CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 8 GPU, 1 CPU)")
    p.add_argument("--max-length", type=int, default=None, help="default 4096 GPU, 256 CPU")
    p.add_argument("--batch-size", type=int, default=None, help="padded: sequences per micro-batch (default 2)")
    p.add_argument("--max-tokens", type=int, default=None, help="padded: tokens per micro-batch (default 8192 GPU, 512 CPU)")
    p.add_argument("--anchors", type=int, default=None, help="padded: anchors per sequence (default 512 GPU, 32 CPU)")
    p.add_argument("--pack-tokens", type=int, default=None, help="packed: tokens per row (default 8192 GPU, 512 CPU)")
    p.add_argument("--pack-anchors", type=int, default=None, help="packed: anchors per row (default 1024 GPU, 64 CPU)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--target-layers", type=int, default=None,
                   help="decoder layers of the target (default: the preset's; fewer let a bf16 27B-wide target fit "
                   "an 80 GB card)")
    p.add_argument("--fp8-target", action="store_true",
                   help="quantise the random target to block FP8 (the 27B shape then fits an 80 GB card)")
    p.add_argument("--without", default="", help=f"comma list of step changes to undo ({', '.join(LEVERS)}): "
                   "the 'before' of a before/after row")
    p.add_argument("--recompute-layers", type=int, default=0,
                   help="the drafter's first N decoder layers recompute their activations in the backward "
                   "(dflash-train --recompute-layers)")
    p.add_argument("--memory-phases", type=int, default=0,
                   help="record GPU memory at each phase of the first N micro-batches (bench/memory_phases.py)")
    p.add_argument("--memory-snapshot", action="store_true",
                   help="record every allocation's stack; on out of memory, list what holds the memory")
    p.add_argument("--fixed-tokens-per-s", type=float, default=None,
                   help="the fixed-shape figure to compare with, where the fixed variant is not run here")
    p.add_argument("--processes", choices=("one", "each"), default=None,
                   help="every variant in this process, or each in a child process of its own (default: each on "
                   "a GPU, one on a CPU)")
    p.add_argument("--json", help="also write the rows here (rewritten as each variant ends)")
    p.add_argument("--work-dir", help="where each variant's run directory is made (default: the system's temporary "
                   "folder)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if gpu else torch.device("cpu")
    for key, on_gpu, on_cpu in (("sequences", 4000, 24), ("steps", 40, 3), ("warmup", 8, 1), ("max_length", 4096, 256),
                                ("batch_size", 2, 2), ("max_tokens", 8192, 512), ("anchors", 512, 32),
                                ("pack_tokens", 8192, 512), ("pack_anchors", 1024, 64)):
        if getattr(args, key) is None:
            setattr(args, key, on_gpu if gpu else on_cpu)
    args.processes = args.processes or ("each" if gpu else "one")
    preset = args.preset or ("27b" if gpu else "large")
    shape = dict(QWEN35_27B if preset == "27b" else scaled_qwen35_shape(args.hidden, args.layers, args.vocab))
    if args.target_layers:
        shape["layers"] = args.target_layers
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for variant in variants:
        if variant not in ("fixed", "padded", "packed"):
            p.error(f"unknown variant {variant!r}; choose from fixed, padded, packed")
    lengths = (lengths_from_file(args.data, args.tokenizer, args.max_length) if args.data else
               chat_mix(args.sequences, args.seed, args.max_length))
    print(json.dumps({"sequences": len(lengths), "median_length": statistics.median(lengths),
                      "min": min(lengths), "max": max(lengths), "preset": preset, "target_layers": shape["layers"], "kind": args.kind,
                      "target": "fp8" if args.fp8_target else "bf16", "processes": args.processes,
                      "without": args.without}), flush=True)

    def save(rows: list[dict]) -> None:  # written whole under another name, then renamed: a reader sees whole rows
        if args.json:
            tmp = Path(f"{args.json}.tmp")
            tmp.write_text(json.dumps({"lengths": {"n": len(lengths), "median": statistics.median(lengths)},
                                       "rows": rows}, indent=2) + "\n")
            tmp.replace(args.json)

    if args.processes == "each" and len(variants) > 1:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # the child goes with us
        rows = []
        for variant in variants:
            rows.append(run_in_child(argv, variant))
            save(rows)
            print(json.dumps(rows[-1]), flush=True)
    else:
        rows = run_here(args, variants, lengths, shape, device, save)
    done = [r for r in rows if "error" not in r]
    print("\n" + report(done, args.fixed_tokens_per_s))
    save(rows)
    return 0 if len(done) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
