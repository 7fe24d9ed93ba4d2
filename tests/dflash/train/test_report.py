"""`dflash report`: the plots of a short CPU run on the tiny target are valid PNG images (signature,
read back by matplotlib and by PIL), report.md names them, and the command line writes them on demand; a run
directory whose metrics.jsonl records nothing usable is refused (exit 2), not reported as zero steps."""

from __future__ import annotations

import json

import pytest

from dflash.cli import main, train_main
from dflash.train.records.run_report import PLOTS, read_records, write_report
from dflash.train.records.rundir import RunDir
from tests.support.bad_input import assert_clear_failure
from tests.support.dflash_train_fixtures import save_chat_target, train_args, write_chat_jsonl

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    target, data = save_chat_target(root / "target"), write_chat_jsonl(root / "chat.jsonl", n=24)
    out = root / "run"
    assert train_main(train_args(target, data, out, max_steps=4, eval_every=2, eval_fraction=0.25)) == 0
    return out


def _check_png(path) -> None:
    import matplotlib.image
    from PIL import Image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] >= 400 and image.size[1] >= 300
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.std() > 0  # not a blank canvas


def test_every_run_ends_with_its_report(run_dir):
    for name in PLOTS:
        _check_png(RunDir(run_dir).report / f"{name}.png")
    text = (RunDir(run_dir).report / "report.md").read_text()
    assert text.startswith(f"# Run report: {run_dir.name}")
    assert "| last evaluation (step 4) |" in text
    assert all(f"({name}.png)" in text for name in PLOTS)


def test_report_on_demand_rewrites_it(run_dir, capsys):
    for name in PLOTS:
        (RunDir(run_dir).report / f"{name}.png").unlink()
    assert main(["report", str(run_dir)]) == 0
    assert "report.md" in capsys.readouterr().out
    for name in PLOTS:
        _check_png(RunDir(run_dir).report / f"{name}.png")


def test_records_take_the_last_of_a_repeated_step(tmp_path):
    lines = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0, "split": "train"},
             {"step": 2, "loss": 2.5, "split": "eval", "tau_est": 1.5},
             {"step": 2, "loss": 1.5, "split": "train"}]  # resumed from step 1: step 2 again
    RunDir(tmp_path).metrics.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 3, "lo')
    train, evals = read_records(tmp_path)
    assert [(r["step"], r["loss"]) for r in train] == [(1, 3.0), (2, 1.5)]
    assert [(r["step"], r["loss"]) for r in evals] == [(2, 2.5)]
    write_report(tmp_path)  # no config.json, no tokens/s: still a report
    _check_png(RunDir(tmp_path).report / "loss.png")
    text = (RunDir(tmp_path).report / "report.md").read_text()
    assert "target and data: unknown (no readable config.json" in text and "built-in demo" not in text


def test_report_of_a_dir_without_metrics_says_so(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("metrics, words", [
    pytest.param("", ("metrics.jsonl is empty: the run in", "has not logged a step, so there is nothing to report",
                      "again once it has logged one"), id="empty"),
    pytest.param("\n\n", ("metrics.jsonl is empty",), id="blank-lines"),
    pytest.param('{"step": 1, "lo', ("holds no training or evaluation record yet",), id="first-line-being-written"),
    pytest.param('[1, 2]\n{"step": "one", "loss": 2.0}\n',
                 ("holds no usable record (2 left out: metrics.jsonl line 1: a JSON list, not a record",
                  'line 2: step is "one"', "Fix or delete those lines"), id="every-line-left-out"),
])
def test_report_of_a_run_that_recorded_nothing_is_refused(tmp_path, capsys, metrics, words):
    """Nothing recorded is an error (exit 2), not a report of zero steps of a "built-in demo"."""
    RunDir(tmp_path).metrics.write_text(metrics)
    code = main(["report", str(tmp_path)])
    assert_clear_failure(code, 2, capsys.readouterr().err, (str(RunDir(tmp_path).metrics), *words))
    assert not RunDir(tmp_path).report.exists()
