"""--config FILE (YAML, JSON, TOML) and flags combine in the documented order: field defaults < demo
defaults < the stored config of --resume < the file < flags; unknown keys name the closest option;
--help shows each default once; every console script answers --version."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflash.cli import train_parser
from dflash.config import DEMO_DEFAULTS, TrainConfig, from_args
from dflash.errors import ConfigError

RUN = {"target": "/models/t", "data": "d.jsonl"}


def _resolve(*argv) -> TrainConfig:
    return from_args(train_parser().parse_args(list(argv)))


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
    assert (cfg.lr, cfg.block_size, cfg.report_to, cfg.target_layer_ids) == (3e-4, 8, ["tensorboard"], [1, 2])
    assert cfg.max_steps == TrainConfig.max_steps  # not the demo's: the file names a target and data


def test_flags_override_the_file_which_overrides_defaults(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({**RUN, "lr": 3e-4, "seed": 5, "epochs": 2}))
    cfg = _resolve("--config", str(path), "--lr", "1e-3", "--epochs", "3")
    assert (cfg.lr, cfg.epochs, cfg.seed, cfg.max_length) == (1e-3, 3, 5, TrainConfig.max_length)


def test_demo_defaults_sit_under_the_file(tmp_path):
    path = tmp_path / "demo.yaml"
    path.write_text("max_steps: 7\n")
    cfg = _resolve("--config", str(path))
    assert cfg.is_demo and cfg.max_steps == 7 and cfg.block_size == DEMO_DEFAULTS["block_size"]


def test_file_overrides_the_resumed_config_and_flags_override_both(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    TrainConfig(**RUN, out=str(out), lr=1e-4, seed=3, max_steps=10).to_json(out / "config.json")
    path = tmp_path / "more.yaml"
    path.write_text("max_steps: 20\nlr: 2e-4\n")
    cfg = _resolve("--out", str(out), "--resume", "--config", str(path), "--lr", "5e-4")
    assert (cfg.seed, cfg.max_steps, cfg.lr, cfg.target) == (3, 20, 5e-4, "/models/t")


def test_a_run_config_json_repeats_the_run(tmp_path):
    stored = TrainConfig(**RUN, out=str(tmp_path / "a"), lr=1e-4, report_to=["tensorboard"])
    stored.to_json(tmp_path / "config.json")
    cfg = _resolve("--config", str(tmp_path / "config.json"), "--out", str(tmp_path / "b"))
    assert {**cfg.to_dict(), "out": stored.out} == stored.to_dict()


@pytest.mark.parametrize("text,message", [
    ("lerning_rate: 1\n", "unknown option 'lerning_rate'"),
    ("block-sise: 8\n", "Did you mean 'block-size'?"),
    ("max_steps: ten\n", "'max_steps' is 'ten'; it must be int"),
    ("progress: 1\n", "'progress' is 1; it must be bool"),
    ("- lr\n", "must hold a mapping"),
    ("lr: [1\n", "not valid YAML"),
    ("max_steps: -1\n", "--max-steps is -1"),
])
def test_bad_files_fail_with_the_reason(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("?", r"\?")):
        _resolve("--config", str(path))


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
