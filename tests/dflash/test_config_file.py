"""--config FILE (YAML, JSON, TOML) and flags combine in the documented order: field defaults < demo
defaults < the stored config of --resume < the file < flags; keys are flat or grouped by section; unknown
keys name the closest option; an option the file gives twice (flat and in its section) is refused, naming
both values; an option of another drafter kind is refused; a run's config.json (nested, or flat as older
runs wrote it) repeats and resumes the run; --help shows each default once; every console script answers
--version."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflash.cli import train_config, train_main, train_parser
from dflash.config import DEMO_DEFAULTS, ModelConfig, OptimConfig, TrainConfig
from dflash.errors import ConfigError
from tests.support.bad_input import assert_clear_failure

RUN = {"target": "/models/t", "data": "d.jsonl"}


def _resolve(*argv) -> TrainConfig:
    return train_config(list(argv))


@pytest.mark.parametrize("suffix,text", [
    (".yaml", "target: /models/t\ndata: d.jsonl\nlr: 3e-4\nblock-size: 8\nreport-to: [tensorboard]\n"
              "target_layer_ids: 1,2\n"),
    (".json", json.dumps({**RUN, "lr": 3e-4, "block_size": 8, "report_to": ["tensorboard"],
                          "target-layer-ids": [1, 2]})),
    (".toml", 'target = "/models/t"\ndata = "d.jsonl"\nlr = 3e-4\nblock-size = 8\nreport-to = ["tensorboard"]\n'
              "target_layer_ids = [1, 2]\n"),
])
def test_file_values_are_read_and_typed(tmp_path, suffix, text):
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    cfg = _resolve("--config", str(path))
    assert (cfg.optim.lr, cfg.model.block_size, cfg.watch.report_to, cfg.model.target_layer_ids) == \
        (3e-4, 8, ["tensorboard"], [1, 2])
    assert cfg.optim.max_steps == OptimConfig.max_steps  # not the demo's: the file names a target and data


def test_flags_override_the_file_which_overrides_defaults(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({**RUN, "lr": 3e-4, "seed": 5, "epochs": 2}))
    cfg = _resolve("--config", str(path), "--lr", "1e-3", "--epochs", "3")
    assert (cfg.optim.lr, cfg.optim.epochs, cfg.optim.seed, cfg.model.max_length) == \
        (1e-3, 3, 5, ModelConfig.max_length)


def test_demo_defaults_sit_under_the_file(tmp_path):
    path = tmp_path / "demo.yaml"
    path.write_text("max_steps: 7\n")
    cfg = _resolve("--config", str(path))
    assert cfg.is_demo and cfg.optim.max_steps == 7 and cfg.model.block_size == DEMO_DEFAULTS["block_size"]


def test_file_overrides_the_resumed_config_and_flags_override_both(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    TrainConfig.from_flat(**RUN, out=str(out), lr=1e-4, seed=3, max_steps=10).to_json(out / "config.json")
    path = tmp_path / "more.yaml"
    path.write_text("max_steps: 20\nlr: 2e-4\n")
    cfg = _resolve("--out", str(out), "--resume", "--config", str(path), "--lr", "5e-4")
    assert (cfg.optim.seed, cfg.optim.max_steps, cfg.optim.lr, cfg.io.target) == (3, 20, 5e-4, "/models/t")


def test_a_run_config_json_repeats_the_run(tmp_path):
    stored = TrainConfig.from_flat(**RUN, out=str(tmp_path / "a"), lr=1e-4, report_to=["tensorboard"])
    stored.to_json(tmp_path / "config.json")
    assert set(json.loads((tmp_path / "config.json").read_text())) == {"io", "model", "optim", "runtime", "watch",
                                                                        "demo"}  # nested, one object per section
    cfg = _resolve("--config", str(tmp_path / "config.json"), "--out", str(tmp_path / "b"))
    assert cfg.replace(out=stored.io.out) == stored


def test_an_older_flat_config_json_resumes_and_repeats(tmp_path):
    """Runs written before the sections stored their options flat; --resume and --config still read them."""
    out = tmp_path / "run"
    out.mkdir()
    flat = {**TrainConfig.from_flat(**RUN, out=str(out), lr=1e-4, block_size=8).to_flat()}
    del flat["overwrite"]  # an option older runs did not have
    (out / "config.json").write_text(json.dumps(flat))
    cfg = _resolve("--out", str(out), "--resume", "--max-steps", "9")
    assert (cfg.optim.lr, cfg.model.block_size, cfg.optim.max_steps, cfg.io.resume) == (1e-4, 8, 9, True)
    assert TrainConfig.from_json(out / "config.json") == TrainConfig.from_flat(flat)
    assert _resolve("--config", str(out / "config.json")).model.block_size == 8


@pytest.mark.parametrize("suffix,text", [
    (".toml", 'target = "/models/t"\ndata = "d.jsonl"\n[optim]\nlr = 3e-4\nmax-steps = 5\n[model]\nblock_size = 8\n'),
    (".yaml", "target: /models/t\ndata: d.jsonl\noptim:\n  lr: 3e-4\n  max-steps: 5\nmodel: {block_size: 8}\n"),
    (".json", json.dumps({**RUN, "optim": {"lr": 3e-4, "max_steps": 5}, "model": {"block-size": 8}})),
])
def test_options_may_be_grouped_by_section(tmp_path, suffix, text):
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    cfg = _resolve("--config", str(path), "--max-steps", "6")
    assert (cfg.optim.lr, cfg.model.block_size, cfg.optim.max_steps) == (3e-4, 8, 6)


@pytest.mark.parametrize("text,message", [
    ("lerning_rate: 1\n", "unknown option 'lerning_rate'"),
    ("block-sise: 8\n", "Did you mean 'block-size'?"),
    ("max_steps: ten\n", "'max_steps' is 'ten'; it must be int"),
    ("progress: 1\n", "'progress' is 1; it must be bool"),
    ("- lr\n", "must hold a mapping"),
    ("lr: [1\n", "not valid YAML"),
    ("max_steps: -1\n", "--max-steps is -1"),
    ("optim:\n  lerning_rate: 1\n", "unknown option 'optim.lerning_rate'"),
    ("optim:\n  max_step: 1\n", "Did you mean 'max_steps'?"),
    ("optim:\n  block_size: 8\n", "'block_size' belongs to the [model] section, not [optim]"),
    ("optim:\n  max_steps: ten\n", "'optim.max_steps' is 'ten'; it must be int"),
    ("max_length: 4096\nmax_tokens: 2048\n", "--max-tokens 2048 is below --max-length 4096"),  # across sections
])
def test_bad_files_fail_with_the_reason(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("?", r"\?")):
        _resolve("--config", str(path))


@pytest.mark.parametrize("suffix,text,words", [
    (".toml", 'target = "/models/t"\ndata = "d.jsonl"\nlr = 1e-3\n[optim]\nlr = 3e-4\n',
     ("'lr' is set twice, as 'lr' = 0.001 and as 'optim.lr' = 0.0003; keep one of them.",)),
    (".yaml", "target: /models/t\ndata: d.jsonl\noptim:\n  max-steps: 5\nmax_steps: 7\n",
     ("'max_steps' is set twice, as 'optim.max-steps' = 5 and as 'max_steps' = 7",)),
    (".json", json.dumps({**RUN, "block-size": 8, "block_size": 16}),
     ("'block_size' is set twice, as 'block-size' = 8 and as 'block_size' = 16",)),
])
def test_an_option_given_twice_in_the_file_is_refused_naming_both(tmp_path, capsys, suffix, text, words):
    """Flat and in its section, or with dashes and underscores: no value wins silently; exit 2 before anything
    is read but the file (/models/t does not exist)."""
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    code = train_main(["--config", str(path), "--out", str(tmp_path / "out")])
    assert_clear_failure(code, 2, capsys.readouterr().err, (f"--config {path}", *words))
    assert not (tmp_path / "out").exists()


def test_an_option_of_another_drafter_kind_is_refused(tmp_path, capsys):
    """--selector-missing is DFlash2's: with a DFlash drafter (the default kind) it would change nothing."""
    code = train_main(["--target", "/models/t", "--data", "d.jsonl", "--out", str(tmp_path / "out"),
                       "--selector-missing", "inject"])
    assert_clear_failure(code, 2, capsys.readouterr().err, (
        "--selector-missing inject is an option of --drafter-kind dflash2, and --drafter-kind is dflash, whose "
        "training would ignore it", "Pass --drafter-kind dflash2", "or drop --selector-missing"))
    assert not (tmp_path / "out").exists()
    path = tmp_path / "run.yaml"
    path.write_text("target: /models/t\ndata: d.jsonl\nmodel: {selector-missing: inject}\n")
    with pytest.raises(ConfigError, match="--selector-missing inject is an option of --drafter-kind dflash2"):
        _resolve("--config", str(path))
    # DFlash2 takes it; its default goes with every kind
    assert _resolve("--config", str(path), "--drafter-kind", "dflash2").model.selector_missing == "inject"
    assert _resolve("--target", "/models/t", "--data", "d.jsonl", "--selector-missing", "drop").model.drafter_kind \
        == "dflash"


def test_unknown_format_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="unknown format '.ini'"):
        _resolve("--config", str(tmp_path / "run.ini"))
    with pytest.raises(ConfigError, match="cannot read it"):
        _resolve("--config", str(tmp_path / "absent.json"))


def test_help_shows_each_default_once():
    text = " ".join(train_parser().format_help().split())
    assert "(default: 7 for block 16, 4 for 8)" in text
    assert "4 for 8) (default" not in text
    for action in train_parser()._actions:
        assert (action.help or "").count("(default:") <= 1, action.dest


@pytest.mark.parametrize("script", ["dflash", "dflash-train", "dflash-eval", "wheelbuilder", "dflash-images"])
def test_every_console_script_has_version(script):
    from importlib.metadata import version

    bin_dir = __import__("pathlib").Path(sys.executable).parent
    out = subprocess.run([str(bin_dir / script), "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{script} {version('dflash-images')}"
