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

This module only parses and dispatches (the parsers and handlers of export, regenerate, report, plan and
the doctor's commands: dflash.commands). Every `*_main(argv) -> int` returns an exit code; a DflashError
(dflash.errors: bad options 2, checkpoint 3, training 4, target 5, data 6, drafter 7, server 8, --out in use
by another run 10) prints one clear message instead of a traceback and exits with its code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from common.cli import DefaultsOnceHelpFormatter, add_version, project_version, run_cli

from dflash.commands import doctor_command, run_export, run_plan, run_regenerate, run_report
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
                    "demo (tiny target, regenerated data, training, then tau beside two baselines). "
                    "Several drafters on one target pass: a --config file with a `drafters` list (TOML: one "
                    "[[drafters]] table per drafter, its name and its own options; docs/training.md), e.g. "
                    "dflash-train --target DIR --data chat.jsonl --out runs/sweep --config sweep.yaml, where "
                    "sweep.yaml is the one line `drafters: [{name: b16}, {name: b8, block-size: 8}]`.",
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


# --- dflash (export, regenerate, report, plan and the doctor's commands: dflash.commands) ----------
@dataclass(frozen=True)
class Subcommand:
    run: Callable[[list[str]], int]
    summary: str
    framed: bool = True  # run under _framed; the doctor's commands handle their own errors and signals


COMMANDS: dict[str, Subcommand] = {
    "train": Subcommand(_train_or_launch, "train a drafter (dflash-train; no options: the built-in demo)"),
    "eval": Subcommand(_eval, "tau, tokens/s and losslessness of a trained drafter (dflash-eval)"),
    "export": Subcommand(run_export, "convert an older project drafter into the reference DFlash layout"),
    "regenerate": Subcommand(run_regenerate, "rewrite a chat JSONL's answers with the target's own responses"),
    "report": Subcommand(run_report, "plots and a summary of a training run (RUN_DIR/report)"),
    "plan": Subcommand(run_plan, "which --layout fits a card: each rank's predicted peak memory and tokens/s"),
    "fp8-write": Subcommand(doctor_command("dflash.model.fp8_checkpoint"), "write the FP8 copy of a bf16 model"),
    "doctor": Subcommand(doctor_command("dflash.doctor.doctor"),
                         "report the GatedDeltaNet kernels, versions and arch coverage", framed=False),
    "healthcheck": Subcommand(doctor_command("dflash.doctor.healthcheck"),
                              "the container health check (cached doctor verdict + trainer heartbeat)", framed=False),
    "entrypoint": Subcommand(doctor_command("dflash.doctor.entrypoint"),
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
