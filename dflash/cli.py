"""Command line: `dflash-train`, `dflash-eval`, and `dflash {train,eval,regenerate,doctor,healthcheck}`.

    dflash-train                                          the built-in demo, end to end (prints tau)
    dflash-train --target DIR --data FILE.jsonl --out DIR train a drafter (every option: --help)
    dflash-train --out DIR --resume                       continue a stopped run
    torchrun --nproc-per-node 8 -m dflash.cli train ...   one process per GPU
    dflash-eval --target DIR --drafter DIR --data FILE.jsonl   tau, tokens/s, losslessness
    dflash regenerate --target DIR --data IN.jsonl --out OUT.jsonl   responses by the target itself
    dflash doctor [...] / dflash healthcheck [...]        kernel report / the image's health check

`dflash-train` is the image's entrypoint, so `docker run dflash-train doctor` must reach the doctor:
a first argument naming a subcommand is dispatched like `dflash <subcommand>`.

Every `*_main(argv) -> int` only returns an exit code; errors with an `exit_code` attribute (bad
options 2, checkpoint 3, training 4) print one clear message instead of a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .config import ConfigError, TrainConfig, add_arguments, atomic_write_text, from_args

log = logging.getLogger("dflash.cli")

SUBCOMMANDS = ("train", "eval", "regenerate", "doctor", "healthcheck")


def _fail(exc: BaseException) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return int(getattr(exc, "exit_code", 1))


def _guard(fn, argv) -> int:
    """Run fn(argv); turn the project's errors into a message and their exit code."""
    from .checkpoint import CheckpointError
    from .train import TrainError

    handled: tuple = (ConfigError, CheckpointError, TrainError)
    try:
        from .target import TargetError
        handled += (TargetError,)
    except ImportError:
        pass
    try:
        from .data import DataError
        handled += (DataError,)
    except ImportError:
        pass
    try:
        return fn(argv)
    except handled as exc:
        return _fail(exc)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


# --- dflash-train ----------------------------------------------------------------------------------
def train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-train",
        description="Train a DFlash drafter for a frozen target. With no --target/--data: the built-in "
                    "demo (tiny target, regenerated data, training, then tau beside two baselines).",
        epilog="Multi-GPU: torchrun --nproc-per-node N -m dflash.cli train [options]. Subcommands: "
               + ", ".join(SUBCOMMANDS) + " (e.g. dflash-train doctor).",
    )
    add_arguments(parser)
    return parser


def _train(argv) -> int:
    config = from_args(train_parser().parse_args(argv))
    if config.is_demo:
        return run_demo(config)
    from .train import train
    return train(config).exit_code


def train_main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        return main(argv)
    return _guard(_train, argv)


# --- dflash-eval -----------------------------------------------------------------------------------
def eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-eval", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description="Speculative decoding with a trained drafter: tau (accepted "
                                            "tokens per target verify step), tokens/s, losslessness.")
    p.add_argument("--target", required=True, help="local HF model dir of the target")
    p.add_argument("--drafter", required=True, help="drafter dir (Drafter.save_pretrained, e.g. <out>/drafter)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="chat JSONL: the user turns before each conversation's first answer are the prompts")
    src.add_argument("--prompts", help="text file, one user prompt per line (wrapped in the chat template)")
    p.add_argument("--limit", type=int, default=32, help="evaluate at most this many prompts")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True,
                   help="also evaluate the repeat-last-token guesser and an untrained drafter")
    p.add_argument("--device", default="auto", help="'auto', 'cpu', 'cuda', 'cuda:N'")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the conversation up to (not including) its first assistant turn, plus the
    generation prompt: what the target sees before it starts answering."""
    head = []
    for m in messages:
        if m["role"] == "assistant":
            break
        head.append(m)
    text = tokenizer.apply_chat_template(head, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _eval(argv) -> int:
    from . import distributed
    from .evaluate import evaluate, evaluate_baseline
    from .model import Drafter
    from .target import Target

    args = eval_parser().parse_args(argv)
    if args.limit < 1 or args.max_new_tokens < 1:
        raise ConfigError("--limit and --max-new-tokens must be at least 1.")
    device = distributed.pick_device(args.device, 0)
    drafter = Drafter.from_pretrained(args.drafter, device=device).eval()
    target = Target.load(args.target, device=device, layer_ids=drafter.config.target_layer_ids,
                         mask_token=drafter.config.mask_token_id)
    if drafter.config.target_fingerprint != target.fingerprint:
        raise ConfigError(f"the drafter in {args.drafter} was trained for a different target (fingerprint "
                          f"{drafter.config.target_fingerprint}, --target gives {target.fingerprint}); pass "
                          "the target it was trained on.")
    if args.data:
        from .data import load_chat_jsonl
        conversations, _ = load_chat_jsonl(args.data)
    else:
        lines = [ln.strip() for ln in Path(args.prompts).read_text().splitlines() if ln.strip()]
        conversations = [[{"role": "user", "content": ln}] for ln in lines]
    prompts = [prompt_ids(target.tokenizer, c) for c in conversations[: args.limit]]
    if not prompts:
        raise ConfigError(f"no prompt found in {args.data or args.prompts}; it needs at least one user turn.")
    results = {"drafter": evaluate(target, drafter, prompts, args.max_new_tokens)}
    if args.baselines:
        for name, kind in (("untrained drafter", "untrained"), ("repeat last token", "repeat_last")):
            results[name] = evaluate_baseline(target, prompts, args.max_new_tokens, kind=kind, config=drafter.config)
    print(json.dumps(results, indent=2, default=str) if args.json else format_results(results))
    return 0 if results["drafter"].get("lossless", True) else 1


def format_results(results: dict[str, dict]) -> str:
    """A small table: one row per method, tau / tokens per second / lossless."""
    rows = [f"{'method':<20} {'tau':>6} {'tokens/s':>10} {'lossless':>9}"]
    for name, r in results.items():
        rows.append(f"{name:<20} {r['tau']:>6.2f} {r['tokens_per_s']:>10.1f} {str(r.get('lossless', '-')):>9}")
    return "\n".join(rows)


def eval_main(argv: list[str] | None = None) -> int:
    return _guard(_eval, sys.argv[1:] if argv is None else list(argv))


# --- dflash regenerate -----------------------------------------------------------------------------
def regenerate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash regenerate", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description="Replace the assistant turns of a chat JSONL with the target's "
                                            "own responses (DFlash trains best on the target's outputs).")
    p.add_argument("--target", required=True, help="local HF model dir of the target")
    p.add_argument("--data", required=True, help="input chat JSONL")
    p.add_argument("--out", required=True, help="output chat JSONL (written atomically)")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="longest regenerated response")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument("--device", default="auto", help="'auto', 'cpu', 'cuda', 'cuda:N'")
    p.add_argument("--on-bad-line", choices=("skip", "stop"), default="skip", help="malformed input lines")
    return p


def write_jsonl(path: Path, conversations: list[list[dict]]) -> None:
    text = "".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in conversations)
    atomic_write_text(Path(path), text)


def _regenerate(argv) -> int:
    from . import distributed
    from .data import load_chat_jsonl, regenerate
    from .target import Target

    args = regenerate_parser().parse_args(argv)
    if args.temperature < 0 or args.max_new_tokens < 1:
        raise ConfigError("--temperature must be >= 0 and --max-new-tokens >= 1.")
    device = distributed.pick_device(args.device, 0)
    target = Target.load(args.target, device=device)
    conversations, report = load_chat_jsonl(args.data, on_error=args.on_bad_line)
    out = regenerate(target, conversations, args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    write_jsonl(Path(args.out), out)
    print(f"wrote {len(out)} conversations to {args.out} ({report})")
    return 0


# --- the built-in demo -----------------------------------------------------------------------------
def _demo_data(config: TrainConfig, target, conversations: list[list[dict]], is_main: bool) -> list[list[dict]]:
    """The demo's training conversations with the target's own answers, cached in <out>/demo-data.jsonl."""
    from . import distributed
    from .data import load_chat_jsonl, regenerate

    path = config.out_dir / "demo-data.jsonl"
    if path.exists():
        cached, _ = load_chat_jsonl(path, on_error="skip")
        if len(cached) == len(conversations):
            return cached
    if is_main:
        log.info("regenerating %d demo answers with the target (greedy)", len(conversations))
        write_jsonl(path, regenerate(target, conversations, config.regen_new_tokens, temperature=0.0))
    distributed.barrier(distributed.init(config.device))
    return load_chat_jsonl(path, on_error="stop")[0]


def run_demo(config: TrainConfig) -> int:
    """Build (or reuse) the tiny demo target, regenerate its data, train, then print tau beside the
    untrained-drafter and repeat-last-token baselines; <out>/eval.json keeps the numbers."""
    from . import distributed
    from .data import ChatDataset
    from .demo import build_demo_target, demo_conversations
    from .evaluate import evaluate, evaluate_baseline
    from .train import dataset_items, load_target, setup_logging, train

    d = distributed.init(config.device, cpu_threads=config.cpu_threads)
    setup_logging(config.out_dir, d.is_main)
    if d.is_main:
        build_demo_target(config.demo_target_dir(), seed=config.seed, progress=config.progress)
    distributed.barrier(d)  # other ranks load the target rank 0 built (cached: no second build)
    path = build_demo_target(config.demo_target_dir(), seed=config.seed, progress=False)
    target = load_target(config, d.device, path)
    conversations = demo_conversations(config.demo_conversations + config.eval_prompts, seed=config.seed)
    held_out = conversations[config.demo_conversations:]
    regenerated = _demo_data(config, target, conversations[: config.demo_conversations], d.is_main)
    dataset = ChatDataset(regenerated, target.tokenizer, max_length=config.max_length,
                          block_size=config.block_size)
    result = train(config, target=target, items=dataset_items(dataset))
    if result.stopped_by or not d.is_main:
        return result.exit_code
    prompts = [prompt_ids(target.tokenizer, c) for c in held_out]
    drafter = result.drafter.eval()
    n, show = config.eval_new_tokens, config.progress
    results = {
        "trained drafter": evaluate(target, drafter, prompts, n, progress=show),
        "untrained drafter": evaluate_baseline(target, prompts, n, kind="untrained", config=drafter.config,
                                               seed=config.seed, progress=show),
        "repeat last token": evaluate_baseline(target, prompts, n, kind="repeat_last", config=drafter.config,
                                               progress=show),
    }
    atomic_write_text(config.out_dir / "eval.json", json.dumps(results, indent=2, default=str) + "\n")
    print(f"\nDFlash demo: {len(prompts)} held-out prompts, {config.eval_new_tokens} new tokens each, "
          f"block size {config.block_size}, {result.step} training steps\n" + format_results(results))
    print(f"drafter: {config.out_dir / 'drafter'}")
    return 0 if results["trained drafter"].get("lossless", True) else 1


# --- dflash ----------------------------------------------------------------------------------------
# The subcommands of the doctor package: imported lazily, they must work without a GPU.
DOCTOR_COMMANDS = {"doctor": "dflash.doctor.run", "healthcheck": "dflash.doctor.healthcheck",
                   "entrypoint": "dflash.doctor.entrypoint"}


def _delegate(command: str, argv: list[str]) -> int:
    import importlib

    return int(importlib.import_module(DOCTOR_COMMANDS[command]).main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    usage = ("usage: dflash {train,eval,regenerate,doctor,healthcheck} [options]\n"
             "  train       train a drafter (dflash-train; no options: the built-in demo)\n"
             "  eval        tau, tokens/s and losslessness of a trained drafter (dflash-eval)\n"
             "  regenerate  rewrite a chat JSONL's answers with the target's own responses\n"
             "  doctor      report the GatedDeltaNet kernels, versions and arch coverage\n"
             "  healthcheck the container health check (cached doctor verdict + trainer heartbeat)\n"
             "  entrypoint  the dflash-train image's entrypoint (background doctor, then the command)\n"
             "Each subcommand takes --help.")
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        return _guard(_train, rest)
    if cmd == "eval":
        return eval_main(rest)
    if cmd == "regenerate":
        return _guard(_regenerate, rest)
    if cmd in DOCTOR_COMMANDS:
        return _delegate(cmd, rest)
    print(f"error: unknown command '{cmd}'.\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
