"""Command line: `dflash-train`, `dflash-eval`, and `dflash {train,eval,export,regenerate,report,plan,doctor,healthcheck}`.

    dflash-train                                          the built-in demo, end to end (prints tau)
    dflash-train --target DIR --data FILE.jsonl --out DIR train a drafter (every option: --help)
    dflash-train --out DIR --resume                       continue a stopped run
    dflash-train --nproc-per-node 8 ...                   one process per GPU (torchrun's launch, with the
                                                          run's own exit code; torchrun -m dflash.cli train works too)
    dflash-train --init-drafter DIR ...                   continue training a drafter (a published one too)
    dflash-train --config sweep.toml                      several drafters on one target pass ([[drafters]])
    dflash-eval --target DIR --drafter DIR --data FILE.jsonl   tau, tokens/s, losslessness
    dflash export OLD_DIR NEW_DIR --target DIR            an older project drafter -> the reference layout
    dflash regenerate --target DIR --data IN.jsonl --out OUT.jsonl   responses by the target itself
    dflash regenerate --endpoint URL --model NAME --data IN.jsonl --out OUT.jsonl   ... by a vLLM/SGLang server
    dflash report RUN_DIR                                 plots and a summary of a run (also written at its end;
                                                          a run of several drafters: also one table and plot of all)
    dflash plan --target 27b --card rtx-pro-6000 --gpus 8 which --layout fits, per-rank memory, tokens/s
    dflash doctor [...] / dflash healthcheck [...]        kernel report / the image's health check

`dflash-train` is the image's entrypoint, so `docker run dflash-train doctor` must reach the doctor:
a first argument naming a subcommand is dispatched like `dflash <subcommand>`.

This module only parses and dispatches. Every `*_main(argv) -> int` returns an exit code; a DflashError
(dflash.errors: bad options 2, checkpoint 3, training 4, target 5, data 6, drafter 7, server 8, --out in use
by another run 10) prints one clear message instead of a traceback and exits with its code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from common.cli import DefaultsOnceHelpFormatter, add_version, project_version, run_cli

from dflash.config import TrainConfig, add_arguments, from_args
from dflash.errors import ConfigError


def _framed(prog: str, fn, argv) -> int:
    """fn(argv) under the project's one command-line frame (common.cli.run_cli): a DflashError becomes its
    message and exit code, Ctrl-C exit code 130, SIGTERM 143 after the same clean-up (training and server
    regeneration handle both signals themselves and finish cleanly first)."""
    return run_cli(prog, lambda: _said_by_rank_0(fn, argv))


def _said_by_rank_0(fn, argv) -> int:
    """Under torchrun, a refusal (a bad option, checkpoint, target, data or drafter, a busy --out) is found
    the same way by every rank: rank 0 says it, the others exit with its code quietly. Faults of one rank
    (out of memory, a lost peer) are said by the rank that meets them."""
    import os

    from dflash.errors import SAID_BY_RANK_0

    try:
        return fn(argv)
    except SAID_BY_RANK_0 as exc:
        if os.environ.get("RANK", "0") == "0":
            raise
        return exc.exit_code


# --- dflash-train ----------------------------------------------------------------------------------
def train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-train",
        description="Train a DFlash drafter for a frozen target. With no --target/--data: the built-in "
                    "demo (tiny target, regenerated data, training, then tau beside two baselines).",
        epilog="Multi-GPU: dflash-train --nproc-per-node N [options] (torchrun's launch, ending with the run's "
               "exit code), or torchrun --nproc-per-node N -m dflash.cli train [options]. Subcommands: "
               + ", ".join(SUBCOMMANDS) + " (e.g. dflash-train doctor).",
    )
    add_version(parser)
    add_arguments(parser)
    return parser


def train_config(argv: list[str]) -> TrainConfig:
    """The TrainConfig that `dflash-train ARGV` runs with (flags, --config file, demo defaults, and with
    --resume the config stored in --out)."""
    from dflash.train.records.rundir import read_stored_config

    return from_args(train_parser().parse_args(argv), read_stored_config)


def _train(argv) -> int:
    config = train_config(argv)
    specs = _drafter_specs(argv, config)
    if config.is_demo:
        if specs:
            raise ConfigError("several drafters per run need --target and --data (the built-in demo trains one).")
        from dflash.demo.run import run_demo
        return run_demo(config)
    from dflash.train.trainer import train
    if specs:
        from dflash.train.multi import train_multi
        return train_multi(config, specs).exit_code
    return train(config).exit_code


def _drafter_specs(argv: list[str], config: TrainConfig) -> list:
    """The drafters of a several-drafter run (the --config file's `drafters`, or a resumed run's); [] for one."""
    from dflash.config.drafters import resolve_drafters

    config_file = getattr(train_parser().parse_args(argv), "config", None)
    return resolve_drafters(config_file, config.io.out, config.io.resume)


def _train_or_launch(argv) -> int:
    """With --nproc-per-node N: start N training processes here (dflash.launcher; each runs _train on the
    other arguments) and end with the run's code; without: train in this process."""
    from dflash.launcher import launch, split_launch

    nproc, rest = split_launch(argv)
    return _train(argv) if nproc is None else launch(nproc, rest)


def train_main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        return main(argv)
    return _framed("dflash-train", _train_or_launch, argv)


# --- dflash-eval -----------------------------------------------------------------------------------
def eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-eval", formatter_class=DefaultsOnceHelpFormatter,
                                description="Speculative decoding with a trained drafter: tau (accepted "
                                            "tokens per target verify step), tokens/s, losslessness.")
    p.add_argument("--target", required=True, help="local HF model dir of the target")
    p.add_argument("--drafter", required=True, help="drafter dir in the reference DFlash layout (config.json + "
                   "model.safetensors): <out>/drafter of dflash-train, or a published drafter")
    p.add_argument("--compare", action="append", default=[], metavar="DIR",
                   help="another drafter for the same target (e.g. a DFlash2 one beside a DFlash one), evaluated "
                        "on the same prompts and printed beside --drafter; repeatable")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="chat JSONL file: the user turns before each conversation's first answer are the prompts")
    src.add_argument("--prompts", help="text file, one user prompt per line (wrapped in the chat template)")
    p.add_argument("--limit", type=int, default=32, help="evaluate at most this many prompts")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True,
                   help="also evaluate the repeat-last-token guesser and an untrained drafter")
    p.add_argument("--device", default="auto", help="'auto', 'cpu', 'cuda', 'cuda:N'")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--cache", action=argparse.BooleanOptionalAction, default=True,
                   help="run the target with its KV cache and GatedDeltaNet states, rolled back exactly after "
                        "a rejected draft (a target without exact rollback runs uncached and says so); "
                        "--no-cache re-runs the whole sequence at every step")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy, output checked token for token against greedy decoding; > 0 = "
                        "speculative sampling (lossless in distribution, not checked per run)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i uses seed + i) and the "
                                                      "untrained-drafter baseline's initialisation")
    add_version(p)
    return p


def _eval(argv) -> int:
    from dflash.decode.run_eval import run_eval

    return run_eval(eval_parser().parse_args(argv))


def eval_main(argv: list[str] | None = None) -> int:
    return _framed("dflash-eval", _eval, sys.argv[1:] if argv is None else list(argv))


# --- dflash export ---------------------------------------------------------------------------------
def export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash export", formatter_class=DefaultsOnceHelpFormatter,
                                description="Convert a drafter written by an older dflash-train (\"format\": "
                                            "\"dflash-drafter/1\") into the reference DFlash layout that vLLM "
                                            "and SGLang serve (README: Serving a trained drafter).")
    p.add_argument("src", help="the older drafter dir (config.json + model.safetensors)")
    p.add_argument("dst", help="new dir to write (must not exist; appears complete or not at all)")
    layers = p.add_mutually_exclusive_group(required=True)
    layers.add_argument("--target", help="local HF model dir of the target it was trained for (gives the layer "
                                         "count and is checked against the drafter)")
    layers.add_argument("--num-target-layers", type=int, help="the target's decoder layer count, when the "
                                                              "target is not at hand")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="dtype of the written weights")
    add_version(p)
    return p


def _export(argv) -> int:
    import torch

    from dflash.io.fit import target_shape
    from dflash.io.legacy import convert_legacy

    args = export_parser().parse_args(argv)
    dst = convert_legacy(args.src, args.dst, target=target_shape(args.target) if args.target else None,
                         num_target_layers=args.num_target_layers,
                         dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    print(f"wrote {dst} (reference DFlash layout, {args.dtype})")
    return 0


# --- dflash regenerate -----------------------------------------------------------------------------
def regenerate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash regenerate", formatter_class=DefaultsOnceHelpFormatter,
                                description="Replace the assistant turns of a chat JSONL with the target's "
                                            "own responses (DFlash trains best on the target's outputs): "
                                            "in this process (--target, the demo and small sets) or through "
                                            "an OpenAI-compatible server (--endpoint, vLLM or SGLang).")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="local HF model dir of the target: generate in this process, write at the end")
    where.add_argument("--endpoint", help="server base URL, e.g. http://localhost:8000; requests go to "
                                          "<URL>/v1/chat/completions (a URL ending in /v1 is taken as is)")
    p.add_argument("--data", required=True, help="input chat JSONL")
    p.add_argument("--out", required=True, help="output chat JSONL (--target: written atomically; --endpoint: "
                                                "appended one conversation at a time)")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="longest regenerated response")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument("--on-bad-line", choices=("skip", "stop"), default="skip", help="malformed input lines")
    local = p.add_argument_group("in process (--target)")
    local.add_argument("--device", default="auto", help="'auto', 'cpu', 'cuda', 'cuda:N'")
    server = p.add_argument_group("through a server (--endpoint)")
    server.add_argument("--model", help="model name the server serves (required with --endpoint)")
    server.add_argument("--concurrency", type=int, default=32, help="conversations in flight at once")
    server.add_argument("--retries", type=int, default=5, help="retries of a request after a connection "
                                                               "error, a timeout, 408, 429 or 5xx")
    server.add_argument("--timeout", type=float, default=600.0, help="seconds a request may wait for the server")
    server.add_argument("--backoff", type=float, default=1.0, help="seconds before the first retry (doubled at "
                                                                   "each retry, with jitter; Retry-After wins)")
    server.add_argument("--resume", action="store_true", help="keep --out and do only the conversations it lacks")
    server.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                        help='passed to the server\'s chat template, e.g. \'{"enable_thinking": false}\'')
    server.add_argument("--api-key-env", default="OPENAI_API_KEY", help="environment variable holding the API "
                                                                        "key (sent as a Bearer token if set)")
    server.add_argument("--max-failures-in-a-row", type=int, default=50, help="stop after this many "
                        "conversations fail one after another (the server is down); 0 = never")
    server.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
    add_version(p)
    return p


def _regenerate(argv) -> int:
    args = regenerate_parser().parse_args(argv)
    if args.endpoint is None:
        from dflash.regenerate.local import regenerate_jsonl

        if args.model or args.resume:
            raise ConfigError("--model and --resume go with --endpoint; --target regenerates in this process "
                              "and writes --out at the end.")
        print(regenerate_jsonl(args.target, args.data, args.out, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, seed=args.seed, device=args.device,
                               on_bad_line=args.on_bad_line))
        return 0
    from dflash.regenerate.server import regenerate_from_args

    summary = regenerate_from_args(args)
    print(summary.message(), file=sys.stderr if summary.exit_code else sys.stdout)
    return summary.exit_code


# --- dflash report ---------------------------------------------------------------------------------
def report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash report", description="Plots (loss, per-position acceptance, tau, "
                                "throughput) and a Markdown summary of a dflash-train run, from its metrics.jsonl, "
                                "into RUN_DIR/report. Every run writes them at its end; this writes them again, "
                                "also while the run goes on. A run of several drafters gets each drafter's report "
                                "and one table and plot comparing them (RUN_DIR/report/compare.md, compare.png).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the --out dir of a dflash-train run")
    add_version(p)
    return p


def _report(argv) -> int:
    from dflash.train.records.run_compare import is_multi_run, write_comparison
    from dflash.train.records.run_report import write_report

    args = report_parser().parse_args(argv)
    warn = lambda m: print(f"dflash report: warning: {m}", file=sys.stderr)  # noqa: E731
    if not is_multi_run(args.run_dir):
        print(f"wrote {write_report(args.run_dir, warn=warn)}")
        return 0
    from dflash.config.drafters import drafter_out, read_plan

    for spec in read_plan(args.run_dir):  # each drafter's own report, then the table and plot of all
        print(f"wrote {write_report(drafter_out(args.run_dir, spec.name), warn=warn)}")
    print(f"wrote {write_comparison(args.run_dir)}")
    return 0


def _plan(argv) -> int:
    from dflash.plan.command import main as plan_main

    return plan_main(argv)


# --- dflash ----------------------------------------------------------------------------------------
def _doctor_command(module: str):
    """A subcommand of the doctor package: imported when run (it must work without a GPU, and the health
    check must stay cheap); it has its own frame and exit codes."""
    def run(argv: list[str]) -> int:
        import importlib

        return int(importlib.import_module(module).main(argv) or 0)
    return run


@dataclass(frozen=True)
class Subcommand:
    run: Callable[[list[str]], int]
    summary: str
    framed: bool = True  # run under _framed; the doctor's commands handle their own errors and signals


COMMANDS: dict[str, Subcommand] = {
    "train": Subcommand(_train_or_launch, "train a drafter (dflash-train; no options: the built-in demo)"),
    "eval": Subcommand(_eval, "tau, tokens/s and losslessness of a trained drafter (dflash-eval)"),
    "export": Subcommand(_export, "convert an older project drafter into the reference DFlash layout"),
    "regenerate": Subcommand(_regenerate, "rewrite a chat JSONL's answers with the target's own responses"),
    "report": Subcommand(_report, "plots and a summary of a training run (RUN_DIR/report)"),
    "plan": Subcommand(_plan, "which --layout fits a card: each rank's predicted peak memory and tokens/s"),
    "fp8-write": Subcommand(_doctor_command("dflash.model.fp8_checkpoint"), "write the FP8 copy of a bf16 model"),
    "doctor": Subcommand(_doctor_command("dflash.doctor.doctor"),
                         "report the GatedDeltaNet kernels, versions and arch coverage", framed=False),
    "healthcheck": Subcommand(_doctor_command("dflash.doctor.healthcheck"),
                              "the container health check (cached doctor verdict + trainer heartbeat)", framed=False),
    "entrypoint": Subcommand(_doctor_command("dflash.doctor.entrypoint"),
                             "the dflash-train image's entrypoint (background doctor, then the command)",
                             framed=False),
}
# What `dflash-train NAME` dispatches like `dflash NAME` (the image's entrypoint is dflash-train).
SUBCOMMANDS = tuple(name for name in COMMANDS if name != "entrypoint")


def _usage() -> str:
    lines = [f"usage: dflash {{{','.join(name for name in COMMANDS if name != 'entrypoint')}}} [options]"]
    lines += [f"  {name:<11} {cmd.summary}" for name, cmd in COMMANDS.items()]
    return "\n".join(lines + ["Each subcommand takes --help; --version prints the version."])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"dflash {project_version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command '{name}'.\n{_usage()}", file=sys.stderr)
        return 2
    command = COMMANDS[name]
    return _framed(f"dflash {name}", command.run, rest) if command.framed else command.run(rest)


if __name__ == "__main__":
    sys.exit(main())
