"""The drafters of one several-drafter run side by side: one table and one plot (`dflash report RUN_DIR` of
such a run also writes each drafter's own report, dflash.train.records.run_report).

    RUN_DIR/report/compare.md     per drafter: its settings, last training and evaluation loss, accuracy,
                                  tau (measured, replayed, estimated: whichever the run recorded) and the
                                  per-position acceptance a_k
    RUN_DIR/report/compare.png    training loss per step of every drafter (left), and the per-position
                                  acceptance a_k of each drafter's last record (right: its last evaluation,
                                  else its last training step)

Each drafter's records are read as its own report reads them (dflash.train.records.run_report.read_records).
"""

from __future__ import annotations

from pathlib import Path

from dflash.config.drafters import DRAFTERS_DIR, read_plan
from dflash.errors import ConfigError
from dflash.train.records.run_report import _fmt, _series, read_config, read_records
from dflash.train.records.rundir import RunDir

SETTINGS = ("block_size", "drafter_layers", "sliding_window", "gamma", "lr", "max_anchors")


def is_multi_run(run_dir) -> bool:
    return bool(read_plan(run_dir))


def _last(records: list[dict]) -> dict:
    return records[-1] if records else {}


def collect(run_dir) -> list[dict]:
    """One entry per drafter of the run: name, settings, train and eval records."""
    specs = read_plan(run_dir)
    if not specs:
        raise ConfigError(f"{run_dir} trains one drafter (no {DRAFTERS_DIR}/drafters.json); `dflash report` writes "
                          "its report without a comparison.")
    out = []
    for spec in specs:
        root = Path(run_dir) / DRAFTERS_DIR / spec.name
        problems: list[str] = []
        train, evals = read_records(root, problems)
        out.append({"name": spec.name, "config": read_config(RunDir(root), problems), "train": train,
                    "evals": evals, "problems": problems})
    return out


def compare_markdown(run_dir, drafters: list[dict]) -> str:
    lines = [f"# Drafters of {Path(run_dir).name}", "",
             "| drafter | " + " | ".join(SETTINGS) + " | steps | train loss | eval loss | accuracy | tau measured | "
             "tau replayed | a_k (per position, last record) |",
             "|---" * (len(SETTINGS) + 9) + "|"]
    for d in drafters:
        last, ev = _last(d["train"]), _last(d["evals"])
        rec = ev or last
        accept = " ".join(_fmt(a, ".2f") for a in rec.get("accept_per_pos", [])) or "-"
        settings = " | ".join(_fmt(d["config"].get(key)) for key in SETTINGS)
        lines.append(f"| {d['name']} | {settings} | {_fmt(last.get('step'))} | {_fmt(last.get('loss'))} | "
                     f"{_fmt(ev.get('loss'))} | {_fmt(rec.get('acc'), '.3f')} | {_fmt(ev.get('tau'), '.2f')} | "
                     f"{_fmt(ev.get('tau_replay'), '.2f')} | {accept} |")
    lines += ["", "Accuracy and a_k: of the last evaluation where the run has one, else of the last training step. "
              "tau: measured by speculative decoding (--eval-tau-prompts) and replayed on the evaluation data.",
              "", "![compare](compare.png)", ""]
    for d in drafters:
        if d["problems"]:
            lines.append(f"- {d['name']}: left out ({len(d['problems'])}): " + "; ".join(d["problems"][:3]))
    return "\n".join(lines) + "\n"


def compare_plot(path: Path, drafters: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(12, 4.2), dpi=100)
    for d in drafters:
        line, = loss_ax.plot(*_series(d["train"], "loss"), lw=1.2, label=d["name"])
        loss_ax.plot(*_series(d["evals"], "loss"), "o", color=line.get_color())
        rec = _last(d["evals"]) or _last(d["train"])
        if rec.get("accept_per_pos"):
            acc_ax.plot(range(1, len(rec["accept_per_pos"]) + 1), rec["accept_per_pos"], "o-", color=line.get_color(),
                        label=f"{d['name']} (step {rec['step']})")
    loss_ax.set(xlabel="optimizer step", ylabel="weighted CE loss", title="Loss (lines: train, dots: eval)")
    acc_ax.set(xlabel="block position k", ylabel="a_k", ylim=(0, 1.02), title="Per-position acceptance")
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def write_comparison(run_dir) -> Path:
    """compare.md and compare.png into RUN_DIR/report; returns the compare.md path."""
    from common.fsutil import atomic_write

    drafters = collect(run_dir)
    out = RunDir(run_dir).report
    try:
        out.mkdir(parents=True, exist_ok=True)
        compare_plot(out / "compare.png", drafters)
        path = out / "compare.md"
        atomic_write(path, compare_markdown(run_dir, drafters))
    except OSError as exc:
        raise ConfigError(f"cannot write the comparison into {out} ({type(exc).__name__}: {exc}); make "
                          f"{run_dir} writable, then run `dflash report` again.") from None
    return path
