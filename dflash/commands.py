"""The smaller subcommands of `dflash` (dflash.cli dispatches them): each one's parser and handler.

    dflash export OLD_DIR NEW_DIR --target DIR        export_parser, run_export
    dflash regenerate --target DIR | --endpoint URL   regenerate_parser, run_regenerate
    dflash report RUN_DIR                             report_parser, run_report
    dflash plan ...                                   run_plan (its parser: dflash.plan.command)
    dflash doctor / healthcheck / fp8-write           doctor_command (each module's own main)

Every handler takes argv and returns an exit code; a DflashError goes up to dflash.cli's frame. The heavy
imports (torch, the model, the server client) happen inside the handlers, so `--help` stays cheap.
"""

from __future__ import annotations

import argparse
import sys

from common.cli import DefaultsOnceHelpFormatter, add_version

from dflash.errors import ConfigError


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


def run_export(argv) -> int:
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


def run_regenerate(argv) -> int:
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


def run_report(argv) -> int:
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


# --- dflash plan -----------------------------------------------------------------------------------
def run_plan(argv) -> int:
    from dflash.plan.command import main as plan_main

    return plan_main(argv)


# --- dflash doctor, healthcheck, fp8-write, entrypoint ---------------------------------------------
def doctor_command(module: str):
    """A subcommand of the doctor package: imported when run (it must work without a GPU, and the health
    check must stay cheap); it has its own frame and exit codes."""
    def run(argv: list[str]) -> int:
        import importlib

        return int(importlib.import_module(module).main(argv) or 0)
    return run
