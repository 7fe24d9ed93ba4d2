"""The `drafters` list of a --config file: read from TOML, YAML and JSON, checked whole before anything
loads (names, unknown keys, options that cannot differ between drafters, bad values named by drafter), and
the list a run stored read back by --resume."""

from __future__ import annotations

import json

import pytest

from dflash.cli import train_config, train_main
from dflash.config.drafters import PER_DRAFTER, drafter_configs, read_drafters, resolve_drafters, write_plan
from dflash.errors import ConfigError

HEAD = 'target = "/models/t"\ndata = "d.jsonl"\nout = "runs/sweep"\nlr = 3e-4\n'


def _toml(tmp_path, body: str):
    path = tmp_path / "sweep.toml"
    path.write_text(HEAD + body)
    return path


def test_each_drafter_is_the_run_config_with_its_own_options_and_directory(tmp_path):
    path = _toml(tmp_path, '[[drafters]]\nname = "b16"\n[[drafters]]\nname = "b8"\nblock-size = 8\n'
                           "[drafters.optim]\nlr = 1e-4\n")
    base = train_config(["--config", str(path)])
    assert base.optim.lr == 3e-4 and base.model.block_size == 16  # the top level, untouched by the drafters
    configs = drafter_configs(base, read_drafters(path))
    assert list(configs) == ["b16", "b8"]
    assert (configs["b16"].model.block_size, configs["b16"].optim.lr) == (16, 3e-4)
    assert (configs["b8"].model.block_size, configs["b8"].optim.lr) == (8, 1e-4)
    assert configs["b8"].io.out == "runs/sweep/drafters/b8" and configs["b8"].io.data == "d.jsonl"


@pytest.mark.parametrize("suffix,text", [
    (".yaml", "target: /t\ndata: d.jsonl\ndrafters:\n  - name: a\n    model: {block-size: 8}\n  - {name: b, lr: 2e-4}\n"),
    (".json", json.dumps({"target": "/t", "data": "d.jsonl",
                          "drafters": [{"name": "a", "model": {"block_size": 8}}, {"name": "b", "lr": "2e-4"}]})),
])
def test_yaml_and_json_list_drafters_too(tmp_path, suffix, text):
    path = tmp_path / f"sweep{suffix}"
    path.write_text(text)
    specs = read_drafters(path)
    assert [(s.name, s.options) for s in specs] == [("a", {"block_size": 8}), ("b", {"lr": 2e-4})]


@pytest.mark.parametrize("body,message", [
    ('[[drafters]]\nname = "a"\n[[drafters]]\nname = "a"\n', "two drafters are named 'a'"),
    ('[[drafters]]\nname = "a/b"\n', "letters, digits"),
    ('[[drafters]]\nblock-size = 8\n', "name is None"),
    ('[[drafters]]\nname = "a"\nblock-sise = 8\n', "Did you mean 'block-size'"),
    ('[[drafters]]\nname = "a"\nmax-length = 512\n', "'max_length' cannot differ between drafters: every drafter "
                                                     "trains on the same tokenised sequences"),
    ('[[drafters]]\nname = "a"\nmask-token = "<m>"\n', "the one target pass and every drafter's blocks use the same mask"),
    ('[[drafters]]\nname = "a"\n[drafters.optim]\nseed = 3\n', "it fixes the data order"),
    ('[[drafters]]\nname = "a"\nlog-every = 3\n', "it is a setting of the whole run"),
    ('[[drafters]]\nname = "a"\nblock-size = "big"\n', "drafter 'a': 'block-size' is 'big'; it must be int"),
    ("drafters = []\n", "non-empty list"),
])
def test_a_bad_list_fails_naming_the_drafter_and_the_fix(tmp_path, body, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_drafters(_toml(tmp_path, body))


def test_a_value_the_run_config_refuses_names_its_drafter(tmp_path):
    path = _toml(tmp_path, '[[drafters]]\nname = "ok"\n[[drafters]]\nname = "tiny"\nblock-size = 1\n')
    with pytest.raises(ConfigError, match="drafter 'tiny': --block-size is 1"):
        drafter_configs(train_config(["--config", str(path)]), read_drafters(path))


def test_the_command_line_refuses_a_bad_list_before_loading_anything(tmp_path, capsys):
    path = _toml(tmp_path, '[[drafters]]\nname = "a"\n[[drafters]]\nname = "b"\nmax-anchors = 0\n')
    # /models/t does not exist: the drafters' options are checked before the target is looked at
    assert train_main(["--config", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "drafter 'b': --max-anchors is 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_resume_reads_the_stored_list_and_refuses_another(tmp_path):
    path = _toml(tmp_path, '[[drafters]]\nname = "a"\n[[drafters]]\nname = "b"\nblock-size = 8\n')
    out = tmp_path / "run"
    write_plan(out, read_drafters(path))
    stored = resolve_drafters(None, str(out), resume=True)
    assert [(s.name, s.options) for s in stored] == [("a", {}), ("b", {"block_size": 8})]
    other = _toml(tmp_path, '[[drafters]]\nname = "a"\n')
    with pytest.raises(ConfigError, match=r"trains drafters \['a', 'b'\], --config lists \['a'\]"):
        resolve_drafters(str(other), str(out), resume=True)


def test_only_options_of_the_drafter_itself_may_differ():
    from dflash.config import OPTIONS

    assert PER_DRAFTER <= OPTIONS.keys()
    assert {OPTIONS[name][0] for name in PER_DRAFTER} == {"model", "optim"}
