"""`dflash plan`: its text and JSON, and one clear message for each bad input."""

from __future__ import annotations

import json

import pytest

from dflash.cli import main
from tests.support.dflash_train_fixtures import save_chat_target


def test_plan_prints_every_layout_and_the_best(capsys):
    assert main(["plan", "--target", "27b", "--card", "rtx-pro-6000", "--gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert "replicate  does not fit" in out and "offload    fits" in out
    assert "target weights 53.8" in out and "host memory 29.4 GB" in out
    assert out.strip().endswith("best: --layout offload (2,054 tokens/s, 88.6 GB per rank)")


def test_plan_json_for_tools(capsys):
    assert main(["plan", "--target", "27b", "--card-gb", "141", "--gpus", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["best"] == "shard" and data["gpus"] == 8 and data["drafter_params"] == 1_835_072_000
    shard = next(o for o in data["options"] if o["layout"] == "shard")
    assert shard["fits"] and shard["ranks"][0]["terms_gb"]["optimizer_state"] == pytest.approx(14.68 / 8, abs=0.01)


def test_plan_reads_a_model_directory(tmp_path, capsys):
    target = save_chat_target(tmp_path / "target")
    assert main(["plan", "--target", str(target), "--card-gb", "8", "--seq-len", "256", "--anchors", "16",
                 "--layout", "replicate"]) == 0
    assert "best: --layout replicate" in capsys.readouterr().out


def test_nothing_fits_exits_1(capsys):
    assert main(["plan", "--target", "27b", "--card", "rtx-5090"]) == 1
    assert "nothing fits" in capsys.readouterr().out


@pytest.mark.parametrize("argv, code, message", [
    (["--target", "27b", "--card", "a100"], 2, "--card a100: unknown card; choose one of h200, rtx-pro-6000, rtx-5090"),
    (["--target", "27b"], 2, "name the card: --card h200 | rtx-pro-6000 | rtx-5090, or --card-gb N"),
    (["--target", "27b", "--card-gb", "-3"], 2, "--card-gb -3.0: a card's memory must be a positive number of GB"),
    (["--target", "27b", "--card", "h200", "--gpus", "0"], 2, "--gpus 0: need at least 1"),
    (["--target", "27b", "--card", "h200", "--anchors", "4096"], 2,
     "--anchors 4096 with --seq-len 4096: anchors sit in the supervised tokens"),
    (["--target", "/nonexistent/model", "--card", "h200"], 5, "no such directory and not a preset"),
])
def test_bad_input_names_the_problem_and_the_fix(argv, code, message, capsys):
    assert main(["plan", *argv]) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_directory_without_config_json(tmp_path, capsys):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    assert main(["plan", "--target", str(tmp_path), "--card", "h200"]) == 5
    assert "is not a model directory (no config.json)" in capsys.readouterr().err
