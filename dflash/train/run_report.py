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
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from dflash.errors import ConfigError
from dflash.train.rundir import RunDir

PLOTS = ("loss", "acceptance", "tau", "throughput")


def read_records(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records) of metrics.jsonl, one per step, by step."""
    path = RunDir(run_dir).metrics
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: {run_dir} is not a dflash-train output dir, or the run "
                          "has not finished a step yet.")
    by_split: dict[str, dict[int, dict]] = {"train": {}, "eval": {}}
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a crash: the rest of the file still counts
            continue
        if isinstance(record, dict) and "step" in record:
            by_split.setdefault(record.get("split", "train"), {})[int(record["step"])] = record
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


def summary_markdown(run_dir: Path, train: list[dict], evals: list[dict], config: dict) -> str:
    last, ev = (train[-1] if train else {}), (evals[-1] if evals else {})
    rates = [r["tokens_per_s"] for r in train if r.get("tokens_per_s")]
    rates.sort()
    lines = [f"# Run report: {Path(run_dir).name}", "",
             f"- target: `{config.get('target') or 'built-in demo'}`, data: `{config.get('data') or 'demo'}`",
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
              "own greedy answers (dflash.train.evaluation)", ""]
    lines += [f"![{name}]({name}.png)" for name in PLOTS]
    return "\n".join(lines) + "\n"


def write_report(run_dir) -> Path:
    """Plots and report.md into <run_dir>/report; returns the report.md path."""
    from common.fsutil import atomic_write

    run = RunDir(run_dir)
    train, evals = read_records(run.root)
    config = run.stored_options()
    out = run.report
    out.mkdir(parents=True, exist_ok=True)
    write_plots(out, train, evals)
    report = out / "report.md"
    atomic_write(report, summary_markdown(run.root, train, evals, config))
    return report
