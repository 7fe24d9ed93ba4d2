"""`dflash plan`: its text and JSON, and one clear message for each bad input (tests/support/bad_input.py:
the exit code, the key words, no traceback), each bad flag or config.json count refused before any work
(a --seq-len beyond the target's context and --layout pipeline on one GPU too); a plan of several GPUs says
what it assumed of their links."""

from __future__ import annotations

import json

import pytest

from dflash.cli import main
from dflash.plan import command, sizes as shapes
from tests.support.bad_input import assert_clear_failure
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
    # one node: the card's own link, assumed (not measured), not an upper bound of the network's
    assert {k: data["communication"][k] for k in ("ring_gbps", "measured", "upper_bound")} == \
        {"ring_gbps": 50.0, "measured": False, "upper_bound": False}


def test_plan_reads_a_model_directory(tmp_path, capsys):
    target = save_chat_target(tmp_path / "target")
    assert main(["plan", "--target", str(target), "--card-gb", "8", "--seq-len", "256", "--anchors", "16",
                 "--layout", "replicate"]) == 0
    assert "best: --layout replicate" in capsys.readouterr().out


def test_nothing_fits_exits_1(capsys):
    assert main(["plan", "--target", "27b", "--card", "rtx-5090"]) == 1
    assert "nothing fits" in capsys.readouterr().out


@pytest.mark.parametrize("argv, code, words", [
    (["--target", "27b", "--card", "a100"], 2, ("--card a100: unknown card; choose one of h200, rtx-pro-6000, rtx-5090",)),
    (["--target", "27b"], 2, ("name the card: --card h200 | rtx-pro-6000 | rtx-5090, or --card-gb N",)),
    (["--target", "/nonexistent/model", "--card", "h200"], 5, ("no such directory and not a preset",)),
])
def test_bad_input_names_the_problem_and_the_fix(argv, code, words, capsys):
    assert_clear_failure(main(["plan", *argv]), code, capsys.readouterr().err, words)


# A flag with a value no run can have: (flags after --target 27b, the words of the refusal), exit 2 each.
BAD_FLAGS = [
    pytest.param(["--card", "h200", "--gpus", "2", "--micro-batches", "0"],
                 ("--micro-batches 0", "must be at least 1", "pass --micro-batches 1 or more"), id="micro-batches-0"),
    pytest.param(["--card", "h200", "--gpus", "4", "--layout", "pipeline", "--target-stages", "-2"],
                 ("--target-stages -2", "must be at least 0", "pass --target-stages 0 or more"), id="target-stages-neg"),
    pytest.param(["--card", "h200", "--gpus", "4", "--target-stages", "4"],
                 ("--target-stages 4 with --gpus 4", "a drafter rank", "--target-stages 3 or fewer"),
                 id="target-stages-leave-no-drafter-rank"),
    pytest.param(["--card", "h200", "--gpus", "0"], ("--gpus 0", "must be at least 1", "pass --gpus 1"), id="gpus-0"),
    pytest.param(["--card", "h200", "--batch-size", "0"], ("--batch-size 0", "pass --batch-size 1"), id="batch-size-0"),
    pytest.param(["--card", "h200", "--seq-len", "1"], ("--seq-len 1", "at least 2"), id="seq-len-1"),
    pytest.param(["--card", "h200", "--anchors", "-1"], ("--anchors -1", "at least 1"), id="anchors-neg"),
    pytest.param(["--card", "h200", "--anchors", "4096"], ("--anchors 4096 with --seq-len 4096", "--anchors 2048"),
                 id="anchors-over-half"),
    pytest.param(["--card", "h200", "--block-size", "1"], ("--block-size 1", "at least 2", "default 16"),
                 id="block-size-1"),
    pytest.param(["--card", "h200", "--drafter-layers", "0"], ("--drafter-layers 0", "at least 1"),
                 id="drafter-layers-0"),
    pytest.param(["--card", "h200", "--sliding-window", "-8"], ("--sliding-window -8", "at least 0"),
                 id="sliding-window-neg"),
    pytest.param(["--card-gb", "-3"], ("--card-gb -3.0: a card's memory must be a positive number of GB",
                                       "mem_get_info"), id="card-gb-neg"),
    pytest.param(["--card", "h200", "--card-gb", "0"], ("--card-gb 0.0", "positive number of GB"),
                 id="card-gb-0-with-card"),
    pytest.param(["--card-gb", "inf"], ("--card-gb inf", "positive number of GB"), id="card-gb-inf"),
    pytest.param(["--card", "h200", "--headroom-gb", "-1"], ("--headroom-gb -1.0", "0 or more GB"), id="headroom-neg"),
    pytest.param(["--card", "h200", "--headroom-gb", "nan"], ("--headroom-gb nan", "0 or more GB"), id="headroom-nan"),
    pytest.param(["--card", "rtx-5090", "--headroom-gb", "40"], ("--headroom-gb 40", "34.2 GB", "less than 34.2"),
                 id="headroom-over-the-card"),
    pytest.param(["--card", "h200", "--gpus", "1", "--layout", "pipeline"],
                 ("--layout pipeline with --gpus 1", "needs --gpus 2 or more",
                  "another --layout (replicate, shard, offload"), id="pipeline-on-one-gpu"),
    pytest.param(["--card", "h200", "--seq-len", "999999999"],
                 ("--seq-len 999999999: the target reads at most 262,144 positions",
                  "max_position_embeddings of the 27b preset", "pass --seq-len 262144 or less"),
                 id="seq-len-beyond-the-context"),
]


@pytest.mark.parametrize("argv, words", BAD_FLAGS)
def test_a_bad_flag_is_refused_by_name_before_the_target_is_read(argv, words, monkeypatch, capsys):
    read = []
    monkeypatch.setattr(command, "target_shape", lambda *a, **k: read.append(a))
    assert_clear_failure(main(["plan", "--target", "27b", *argv]), 2, capsys.readouterr().err, words)
    assert not read, "the flags were checked only after the target was read"


# A small Qwen3 target's config.json: no weights, the planner reads nothing else.
TINY_CONFIG = {"model_type": "qwen3", "hidden_size": 32, "num_hidden_layers": 4, "vocab_size": 320,
               "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def write_config(directory, config: dict):
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_tiny_config_json_plans(tmp_path, capsys):
    """The config the rows below break one key of is sound: each refusal is that key's."""
    target = write_config(tmp_path / "target", TINY_CONFIG)
    assert main(["plan", "--target", str(target), "--card-gb", "8", "--seq-len", "256", "--anchors", "16",
                 "--layout", "replicate"]) == 0
    assert "hidden 32, vocabulary 320" in capsys.readouterr().out


@pytest.mark.parametrize("change, words", [
    pytest.param({"hidden_size": 0}, ('"hidden_size" is 0', "width"), id="hidden-size-0"),
    pytest.param({"hidden_size": -4}, ('"hidden_size" is -4',), id="hidden-size-neg"),
    pytest.param({"hidden_size": "32"}, ('"hidden_size" is "32"', "whole number"), id="hidden-size-string"),
    pytest.param({"hidden_size": True}, ('"hidden_size" is true',), id="hidden-size-bool"),
    pytest.param({"num_hidden_layers": 0}, ('"num_hidden_layers" is 0', "decoder layer count"), id="layers-0"),
    pytest.param({"vocab_size": 0}, ('"vocab_size" is 0', "vocabulary size"), id="vocab-0"),
    pytest.param({"intermediate_size": 0}, ('"intermediate_size" is 0', "MLP width"), id="intermediate-0"),
    pytest.param({"num_attention_heads": 0}, ('"num_attention_heads" is 0',), id="heads-0"),
    pytest.param({"num_key_value_heads": -2}, ('"num_key_value_heads" is -2',), id="kv-heads-neg"),
    pytest.param({"head_dim": 0}, ('"head_dim" is 0',), id="head-dim-0"),
    pytest.param({"model_type": "qwen3_5", "text_config": {**TINY_CONFIG, "model_type": "qwen3_5_text",
                                                           "hidden_size": 0}},
                 ('"text_config.hidden_size" is 0',), id="text-config-hidden-size-0"),
])
def test_a_nonsense_size_in_config_json_is_refused_by_name(change, words, tmp_path, monkeypatch, capsys):
    built = []
    monkeypatch.setattr(shapes, "_build_on_meta", lambda config: built.append(config))
    target = write_config(tmp_path / "target", {**TINY_CONFIG, **change})
    code = main(["plan", "--target", str(target), "--card", "h200"])
    assert_clear_failure(code, 5, capsys.readouterr().err,
                         (str(target / "config.json"), *words, "at least 1", "Restore the config.json"))
    assert not built, "the model was built from the nonsense config"


def test_a_seq_len_beyond_the_context_of_config_json_is_refused_before_the_model_is_built(tmp_path, monkeypatch,
                                                                                          capsys):
    built = []
    monkeypatch.setattr(shapes, "_build_on_meta", lambda config: built.append(config))
    target = write_config(tmp_path / "target", {**TINY_CONFIG, "max_position_embeddings": 512})
    code = main(["plan", "--target", str(target), "--card", "h200", "--seq-len", "1024", "--anchors", "16"])
    assert_clear_failure(code, 2, capsys.readouterr().err, (
        "--seq-len 1024: the target reads at most 512 positions", f"max_position_embeddings of {target}'s config.json",
        "pass --seq-len 512 or less"))
    assert not built, "the model was built before --seq-len was checked"
    # a packed row holds several sequences, each with its own positions: --pack-tokens is not bound by it
    assert shapes.context_length(str(target)) == 512 and shapes.context_length(str(tmp_path / "none")) is None


def test_a_plan_for_several_nodes_counts_the_network_and_says_what_it_assumed(capsys):
    """100,000 GPUs: each step's collectives cross the network between nodes (50 GB/s per GPU, 10 us per ring
    step), so tokens/s grows far slower than the GPUs, and the output says the rates are assumed and the figure
    an upper bound."""
    assert main(["plan", "--target", "27b", "--card", "h200", "--gpus", "1", "--layout", "shard"]) == 0
    one = float(capsys.readouterr().out.split("predicted ")[1].split(" tokens/s")[0].replace(",", ""))
    assert main(["plan", "--target", "27b", "--card", "h200", "--gpus", "100000", "--layout", "shard"]) == 0
    out = capsys.readouterr().out
    many = float(out.split("predicted ")[1].split(" tokens/s")[0].replace(",", ""))
    assert many < 0.1 * 100_000 * one
    assert ("as rings over 12,500 nodes of 8 GPUs, whose slowest link is the network between nodes at 50 GB/s per "
            "GPU, 10 us per ring step") in out
    assert "These rates are assumed, not measured" in out and "read the figure as an upper bound" in out
    assert main(["plan", "--target", "27b", "--card", "h200", "--gpus", "100000", "--layout", "shard", "--json"]) == 0
    links = json.loads(capsys.readouterr().out)["communication"]
    assert (links["ring_gbps"], links["measured"], links["upper_bound"]) == (50.0, False, True)


def test_a_directory_without_config_json(tmp_path, capsys):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    assert main(["plan", "--target", str(tmp_path), "--card", "h200"]) == 5
    assert "is not a model directory (no config.json)" in capsys.readouterr().err
