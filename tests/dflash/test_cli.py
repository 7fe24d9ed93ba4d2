"""The command line: generated --help, option precedence, clear errors with exit codes, and the
eval / regenerate / doctor / healthcheck commands on a real tiny target."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.cli import main, train_config, train_main
from dflash.config import DEMO_DEFAULTS, OPTIONS, SECTIONS, ModelConfig, TrainConfig
from dflash.errors import ConfigError
from dflash.train.records.rundir import RunDir
from tests.support.dflash_train_fixtures import save_chat_target, train_args, write_chat_jsonl

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return save_chat_target(root / "target"), write_chat_jsonl(root / "chat.jsonl", n=12)


def _parse(argv: list[str]) -> TrainConfig:
    return train_config(argv)


def test_help_lists_every_option_with_its_default_in_its_sections_group():
    run = subprocess.run([sys.executable, "-m", "dflash.cli", "train", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    text = " ".join(run.stdout.split())  # argparse wraps lines
    headings = [text.index(f"{cls.TITLE}:") for cls in SECTIONS.values()]
    assert headings == sorted(headings)  # one group per section, in the sections' order
    for section, f, _type in OPTIONS.values():
        flag = "--" + f.name.replace("_", "-")
        position = headings[0] + re.search(re.escape(flag) + "[ ,]", text[headings[0]:]).start()
        own = list(SECTIONS).index(section)
        assert headings[own] < position < (headings[own + 1] if own + 1 < len(headings) else len(text)), flag
        assert flag in text, flag
        shown = ",".join(map(str, f.default)) if isinstance(f.default, list) else f.default
        said = "(default:" in f.metadata["help"]  # a help that says its default in words shows only that
        assert (f.metadata["help"] if said else f"{f.metadata['help']} (default: {shown})") in text, flag
        assert text.count(f"{f.metadata['help']} (default:") == int(not said), flag


def test_train_help_says_how_to_train_several_drafters_with_an_example_that_parses(tmp_path, monkeypatch):
    """`dflash-train --help` names the --config file's `drafters` list and gives a one-line example; the example
    is run through the real reader: the command line it shows and the file it shows give the drafters it says."""
    from dflash.cli import train_parser
    from dflash.config.drafters import drafter_configs, resolve_drafters

    text = " ".join(train_parser().format_help().split())  # argparse wraps lines
    assert "Several drafters on one target pass: a --config file with a `drafters` list" in text
    assert "[[drafters]]" in text
    example = re.search(r"e\.g\. dflash-train (.+?), where (\S+) is the one line `(.+?)`", text)
    assert example, text
    argv, name, line = example.group(1).split(), example.group(2), example.group(3)
    assert argv[argv.index("--config") + 1] == name
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text(line + "\n")
    config = train_config(argv)
    specs = resolve_drafters(name, config.io.out, config.io.resume)
    configs = drafter_configs(config, specs)
    assert {n: c.model.block_size for n, c in configs.items()} == {"b16": 16, "b8": 8}
    assert configs["b8"].io.out == "runs/sweep/drafters/b8"


def test_demo_defaults_apply_only_without_target_and_data(tmp_path):
    demo = _parse([])
    assert demo.is_demo and demo.model.block_size == DEMO_DEFAULTS["block_size"]
    assert _parse(["--block-size", "4"]).model.block_size == 4  # a given flag beats the demo's choice
    real = _parse(["--target", "t", "--data", "d.jsonl"])
    assert not real.is_demo and real.model.block_size == ModelConfig.block_size


def test_resume_reads_the_stored_config_and_flags_override_it(tmp_path):
    TrainConfig.from_flat(target="t", data="d.jsonl", out=str(tmp_path), block_size=8, lr=1e-3,
                          overwrite=True).to_json(RunDir(tmp_path).config)
    cfg = _parse(["--out", str(tmp_path), "--resume", "--max-steps", "50"])
    assert (cfg.io.target, cfg.model.block_size, cfg.optim.lr, cfg.optim.max_steps, cfg.io.resume) == \
        ("t", 8, 1e-3, 50, True)
    assert not cfg.io.overwrite  # the run started with --overwrite; continuing it deletes nothing


def test_list_flag_and_unknown_config_keys():
    assert _parse(["--target", "t", "--data", "d", "--target-layer-ids", "1, 3,5"]).model.target_layer_ids == [1, 3, 5]
    with pytest.raises(ConfigError, match="unknown option 'block_sise'.*Did you mean 'block_size'"):
        TrainConfig.from_dict({"block_sise": 8})
    with pytest.raises(ConfigError, match="unknown option 'lerning_rate'"):
        TrainConfig.from_flat(lerning_rate=1e-3)


@pytest.mark.parametrize("argv, message", [
    (["--target", "t"], "--target and --data go together; add --data"),
    (["--block-size", "1"], "--block-size is 1"),
    (["--lr", "0"], "--lr is 0.0; it must be positive"),
    (["--max-length", "2048", "--max-tokens", "1024"], "--max-tokens 1024 is below --max-length 2048"),
    (["--precision", "fp8"], None),  # argparse rejects the choice itself
])
def test_bad_options_exit_2_with_a_message(argv, message, capsys):
    if message is None:
        with pytest.raises(SystemExit) as exc:
            train_main(argv)
        assert exc.value.code == 2
        assert "invalid choice: 'fp8'" in capsys.readouterr().err
        return
    assert train_main(argv) == 2
    assert message in capsys.readouterr().err


def test_dflash_without_a_command_prints_usage(capsys):
    assert main([]) == 2
    assert "regenerate" in capsys.readouterr().out
    assert main(["bogus"]) == 2
    assert "unknown command 'bogus'" in capsys.readouterr().err


def test_subcommands_reach_the_health_check_even_through_dflash_train(tmp_path, capsys):
    """`docker run dflash-train healthcheck` runs `dflash-train healthcheck`: it must reach
    dflash.doctor.healthcheck.main, which reports a missing doctor verdict as unhealthy (exit 1)."""
    args = ["--report", str(tmp_path / "none.json"), "--heartbeat", str(tmp_path / "hb")]
    assert train_main(["healthcheck", *args]) == 1
    assert "doctor has not finished" in capsys.readouterr().out
    (tmp_path / "none.json").write_text(json.dumps({"schema": 0}))
    assert main(["healthcheck", *args]) == 1


def test_regenerate_writes_the_targets_answers(tiny, tmp_path):
    target, data = tiny
    src = tmp_path / "in.jsonl"
    src.write_text("".join(data.read_text().splitlines(keepends=True)[:3]) + "not json\n")
    out = tmp_path / "out.jsonl"
    assert main(["regenerate", "--target", str(target), "--data", str(src), "--out", str(out),
                 "--max-new-tokens", "3", "--device", "cpu"]) == 0
    rows = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    originals = [json.loads(line)["messages"] for line in src.read_text().splitlines()[:3]]
    assert len(rows) == 3  # the bad line was skipped and counted
    for new, old in zip(rows, originals):
        assert [m["role"] for m in new] == [m["role"] for m in old]
        assert [m["content"] for m in new if m["role"] == "user"] == [m["content"] for m in old if m["role"] == "user"]


def test_eval_reports_tau_and_losslessness(tiny, tmp_path, capsys):
    target, data = tiny
    out = tmp_path / "run"
    assert train_main(train_args(target, data, out, max_steps=1)) == 0
    capsys.readouterr()
    argv = ["--target", str(target), "--drafter", str(RunDir(out).drafter), "--data", str(data), "--limit", "2",
            "--max-new-tokens", "6", "--device", "cpu", "--json"]
    assert main(["eval", *argv]) == 0
    results = json.loads(capsys.readouterr().out)
    assert set(results) == {"drafter", "untrained drafter", "repeat last token"}
    for r in results.values():
        assert r["lossless"] is True and r["n_prompts"] == 2 and r["tau"] >= 1.0


def test_eval_refuses_a_drafter_of_another_target(tiny, tmp_path, capsys):
    target, data = tiny
    out = tmp_path / "run"
    assert train_main(train_args(target, data, out, max_steps=1)) == 0
    other = save_chat_target(tmp_path / "other", num_layers=8)
    assert main(["eval", "--target", str(other), "--drafter", str(RunDir(out).drafter), "--data", str(data),
                 "--device", "cpu"]) == 7
    assert "trained for a different target: num_target_layers 4 != the target's 8 layers" in capsys.readouterr().err


def test_sigterm_outside_training_unwinds_and_exits_143(tmp_path, capsys):
    """eval, export and report get SIGTERM like Ctrl-C: `finally` blocks run, exit code 143."""
    import os
    import signal
    import time

    from dflash.cli import _framed

    cleaned = []

    def body(_argv):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # never reached in full: the handler raises at once
            return 0
        finally:
            cleaned.append(True)

    before = signal.getsignal(signal.SIGTERM)
    assert _framed("dflash test", body, []) == 143
    assert cleaned == [True]
    assert "dflash test: SIGTERM received" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is restored afterwards
