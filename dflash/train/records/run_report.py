"""`dflash report RUN_DIR`: plots and a Markdown summary of a training run, from its metrics.jsonl.

    RUN_DIR/report/loss.png        training loss per step (and its moving average), evaluation loss
    RUN_DIR/report/acceptance.png  per-position acceptance a_k and accuracy at the first, middle and
                                   last evaluation (training records when the run has no evaluation)
    RUN_DIR/report/tau.png         tau measured by speculative decoding and replayed on the data at each
                                   evaluation (--eval-tau-prompts; none without it)
    RUN_DIR/report/throughput.png  tokens/s, and MFU on a GPU
    RUN_DIR/report/report.md       the run's settings and last numbers, with the plots

The trainer writes it at the end of every run (rank 0); `dflash report` writes it again at any time,
also while the run goes on. A step recorded twice (a run resumed from an earlier checkpoint) counts
with its last record. Plots use matplotlib's Agg backend: no display needed.

metrics.jsonl is read leniently, since the run may still be writing it: a last line cut short is left
out silently. Anything else the report cannot use (a line that is not a JSON object, a step that is not a
whole number, a value of the wrong type such as "loss": "abc") is left out of the report and named,
line by line, in a warning and in report.md; the rest of the file still counts. A file with no usable
record at all (empty, or every line left out) is refused (ConfigError, exit 2): there is nothing to report.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

from dflash.errors import ConfigError, DflashError
from dflash.train.records.rundir import RunDir

log = logging.getLogger("dflash.train")

PLOTS = ("loss", "acceptance", "tau", "throughput")
# The fields of a metrics record the report reads: each a number, or a list of numbers.
NUMBER_FIELDS = ("loss", "acc", "tau_est", "tau", "tau_replay", "tokens_per_s", "mfu", "gpu_mem_gib", "lr",
                 "grad_norm", "tokens", "anchors", "eval_s", "tau_prompts")
LIST_FIELDS = ("acc_per_pos", "accept_per_pos")
SPLITS = ("train", "eval")
MAX_PROBLEMS_SHOWN = 5


def _number(value) -> float | None:
    """`value` as a float when it is a JSON number (not a bool, not too large for a float), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def _step(value) -> int | None:
    number = _number(value)
    if number is None or not math.isfinite(number) or not number.is_integer() or number < 0:
        return None
    return int(number)


def _short(value) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def clean_record(record: dict, where: str, problems: list[str]) -> dict | None:
    """The record with every field the report reads of the right type, or None when its step or split is
    unusable; each value left out is described in `problems`."""
    step = _step(record.get("step"))
    if step is None:
        problems.append(f"{where}: step is {_short(record.get('step'))}, not a whole number >= 0; the line is "
                        "left out")
        return None
    split = record.get("split", "train")
    if not isinstance(split, str):
        problems.append(f"{where}: split is {_short(split)}, not \"train\" or \"eval\"; the line is left out")
        return None
    out = {**record, "step": step, "split": split}
    for key in NUMBER_FIELDS + LIST_FIELDS:  # null: the field is absent
        if key in out and out[key] is None:
            del out[key]
    for key in NUMBER_FIELDS:
        if key in out:
            number = _number(record[key])
            if number is None:
                problems.append(f"{where}: {key} is {_short(record[key])}, not a number")
                del out[key]
            else:
                out[key] = number
    for key in LIST_FIELDS:
        if key in out:
            value = record[key]
            numbers = [_number(v) for v in value] if isinstance(value, list) else None
            if numbers is None or any(v is None for v in numbers):
                problems.append(f"{where}: {key} is {_short(value)}, not a list of numbers")
                del out[key]
            else:
                out[key] = numbers
    return out


def read_records(run_dir: Path, problems: list[str] | None = None) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records) of metrics.jsonl, one per step, by step. What had to be left
    out (module docstring) is appended to `problems`."""
    problems = [] if problems is None else problems
    path = RunDir(run_dir).metrics
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: {run_dir} is not a dflash-train output dir, or the run "
                          "has not finished a step yet.")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path} ({exc}); make it readable, or pass the run's --out dir.") from None
    by_split: dict[str, dict[int, dict]] = {split: {} for split in SPLITS}
    lines = data.split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        where = f"{path.name} line {i + 1}"
        try:
            record = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError; a too deep nest
            if i != last:  # the last line may be one the run is writing, or one cut by a crash
                problems.append(f"{where}: not JSON ({type(exc).__name__}); the line is left out")
            continue
        if not isinstance(record, dict):
            problems.append(f"{where}: a JSON {type(record).__name__}, not a record; the line is left out")
            continue
        record = clean_record(record, where, problems)
        if record is not None and record["split"] in by_split:  # other splits: not plotted
            by_split[record["split"]][record["step"]] = record
    return ([by_split["train"][s] for s in sorted(by_split["train"])],
            [by_split["eval"][s] for s in sorted(by_split["eval"])])


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))
             and math.isfinite(r[key])]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _moving_average(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def _plot_loss(ax, train, evals):
    steps, loss = _series(train, "loss")
    ax.plot(steps, loss, color="tab:blue", alpha=0.3, lw=1, label="train")
    if len(loss) > 5:
        ax.plot(steps, _moving_average(loss, max(2, len(loss) // 20)), color="tab:blue", lw=2,
                label="train (moving average)")
    ax.plot(*_series(evals, "loss"), "o-", color="tab:orange", label="eval")
    ax.set(xlabel="optimizer step", ylabel="weighted CE loss", title="Loss")


def _plot_acceptance(ax, train, evals):
    records = evals or train
    picks = sorted({0, len(records) // 2, len(records) - 1}) if records else []
    for color, i in zip(("tab:blue", "tab:orange", "tab:green"), picks):
        r = records[i]
        for key, style in (("accept_per_pos", "o-"), ("acc_per_pos", "x:")):
            if r.get(key):
                name = "a_k" if key == "accept_per_pos" else "accuracy"
                ax.plot(range(1, len(r[key]) + 1), r[key], style, color=color, label=f"{name}, step {r['step']}")
    ax.set(xlabel="block position k", ylabel="rate", ylim=(0, 1.02),
           title=f"Per-position acceptance ({'eval' if evals else 'train'})")


def _plot_tau(ax, train, evals):
    if not any("tau" in r for r in evals):
        ax.text(0.5, 0.5, "no tau measured: --eval-tau-prompts N measures it at each evaluation",
                ha="center", va="center", transform=ax.transAxes)
    ax.plot(*_series(evals, "tau"), "s--", color="tab:green", label="measured (speculative decoding)")
    ax.plot(*_series(evals, "tau_replay"), "^:", color="tab:purple", label="replayed on the eval data")
    ax.set(xlabel="optimizer step", ylabel="tokens per verify step", title="tau")


def _plot_throughput(ax, train, evals):
    ax.plot(*_series(train, "tokens_per_s"), color="tab:blue", label="tokens/s")
    ax.set(xlabel="optimizer step", ylabel="tokens/s", title="Throughput")
    steps, mfu = _series(train, "mfu")
    if mfu:
        twin = ax.twinx()
        twin.plot(steps, [100 * m for m in mfu], color="tab:red", label="MFU")
        twin.set_ylabel("MFU (%)")
        twin.legend(loc="lower right")


def write_plots(out: Path, train: list[dict], evals: list[dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a training host
    import matplotlib.pyplot as plt

    paths = []
    for name, draw in zip(PLOTS, (_plot_loss, _plot_acceptance, _plot_tau, _plot_throughput)):
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
        draw(ax, train, evals)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, format="png")
        plt.close(fig)
        paths.append(path)
    return paths


def _fmt(value, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec) if isinstance(value, (int, float)) else str(value)


def summary_markdown(run_dir: Path, train: list[dict], evals: list[dict], config: dict,
                     problems: list[str] = ()) -> str:
    last, ev = (train[-1] if train else {}), (evals[-1] if evals else {})
    rates = [r["tokens_per_s"] for r in train if r.get("tokens_per_s")]
    rates.sort()
    inputs = (f"- target: `{config.get('target') or 'built-in demo'}`, data: `{config.get('data') or 'demo'}`"
              if config else "- target and data: unknown (no readable config.json beside metrics.jsonl)")
    lines = [f"# Run report: {Path(run_dir).name}", "", inputs,
             f"- block size {config.get('block_size', '-')}, drafter layers {config.get('drafter_layers', '-')}, "
             f"lr {config.get('lr', '-')}",
             f"- steps recorded: {len(train)} (last: {last.get('step', '-')}), evaluations: {len(evals)}", "",
             "| | loss | accuracy | tau replayed | tau measured |", "|---|---|---|---|---|",
             f"| last training step | {_fmt(last.get('loss'))} | {_fmt(last.get('acc'), '.3f')} | - | - |"]
    if ev:
        lines.append(f"| last evaluation (step {ev['step']}) | {_fmt(ev.get('loss'))} | {_fmt(ev.get('acc'), '.3f')} | "
                     f"{_fmt(ev.get('tau_replay'), '.2f')} | "
                     f"{_fmt(ev.get('tau'), '.2f')} |")
    lines += ["", f"- throughput: median {_fmt(rates[len(rates) // 2] if rates else None, '.0f')} tokens/s"
              + (f", MFU {_fmt(100 * last['mfu'], '.1f')} %" if last.get("mfu") is not None else "")
              + (f", peak GPU memory {_fmt(max(r.get('gpu_mem_gib', 0) for r in train), '.1f')} GiB"
                 if last.get("gpu_mem_gib") is not None else ""),
              "- tau measured: speculative decoding of --eval-tau-prompts evaluation prompts; tau replayed: "
              "greedy verification replayed on their data, the same decoding when the data is the target's "
              "own greedy answers (dflash.train.evaluation)"]
    if problems:
        lines.append(f"- left out of this report ({len(problems)}): {_shown(problems)}")
    lines.append("")
    lines += [f"![{name}]({name}.png)" for name in PLOTS]
    return "\n".join(lines) + "\n"


def read_config(run: RunDir, problems: list[str]) -> dict:
    """The run's options, flat (its settings for the summary), or {} when config.json is missing or cannot be
    read as a run's config (then described in `problems`)."""
    try:
        return run.stored_options()
    except (DflashError, TypeError, ValueError, RecursionError) as exc:  # TypeError: a value of a wrong type
        text = " ".join(str(exc).split())
        problems.append(f"{run.config.name}: cannot be read as the run's settings ({type(exc).__name__}: "
                        f"{text[:120]}); they are left out")
        return {}


def _shown(problems: list[str]) -> str:
    return "; ".join(problems[:MAX_PROBLEMS_SHOWN]) + ("; ..." if len(problems) > MAX_PROBLEMS_SHOWN else "")


def nothing_recorded(run: RunDir, problems: list[str]) -> ConfigError:
    """The refusal of a report of a metrics.jsonl without one usable record: no plot, no summary of nothing."""
    if problems:
        return ConfigError(f"{run.metrics} holds no usable record ({len(problems)} left out: {_shown(problems)}), "
                           "so there is nothing to report. Fix or delete those lines, or pass the --out dir of a "
                           "run that has logged a step.")
    what = "holds no training or evaluation record yet" if run.metrics.read_bytes().strip() else "is empty"
    return ConfigError(f"{run.metrics} {what}: the run in {run.root} has not logged a step, so there is nothing "
                       "to report. A run writes a line every --log-every optimizer steps; run `dflash report "
                       f"{run.root}` again once it has logged one.")


def write_report(run_dir, warn: Callable[[str], None] | None = None) -> Path:
    """Plots and report.md into <run_dir>/report; returns the report.md path. Whatever had to be left out
    goes to `warn` (default: the log), one message. A metrics.jsonl without one usable record (empty, or
    every line left out) is refused (ConfigError): there is nothing to report."""
    from common.fsutil import atomic_write

    run = RunDir(run_dir)
    problems: list[str] = []
    train, evals = read_records(run.root, problems)
    if not train and not evals:
        raise nothing_recorded(run, problems)
    config = read_config(run, problems)
    if problems:
        (warn or log.warning)(f"left out of the report of {run.root} ({len(problems)}): {_shown(problems)}. Fix "
                              "or delete those lines to have them in it.")
    out = run.report
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_plots(out, train, evals)
        report = out / "report.md"
        atomic_write(report, summary_markdown(run.root, train, evals, config, problems))
    except OSError as exc:
        raise ConfigError(f"cannot write the report into {out} ({type(exc).__name__}: {exc}); make {run.root} "
                          "writable (and free disk space), then run `dflash report` again.") from None
    return report
