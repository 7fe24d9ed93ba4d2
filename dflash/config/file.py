"""`dflash-train --config FILE`: TrainConfig values from a YAML, JSON or TOML file.

    # run.yaml                            dflash-train --config run.yaml --lr 3e-4
    target: /models/Qwen3-8B              (flags win over the file: lr is 3e-4 here)
    data: data/regenerated.jsonl
    out: runs/qwen3-8b
    block-size: 16                        (keys as flags without the dashes, or as field names: block_size)
    report-to: [tensorboard]
    optim:                                (or grouped by section, as `dflash-train --help` groups them and
      lr: 6e-4                             as a run's config.json stores them: io, model, optim, runtime,
                                           watch, demo; in TOML a table: [optim])

The format follows the suffix: .yaml/.yml (PyYAML), .json, .toml (tomllib). Keys are the options of
`dflash-train --help`; an unknown key, or an option under another section than its own, fails and names
the fix. Values are checked against each option's type here (YAML reads `6e-4` as a string: numbers in
strings are converted as the command line would), and the whole config is checked by TrainConfig
afterwards. The run's resolved config is written to <out>/config.json as always, so `--config
<out>/config.json` repeats a run (also the flat config.json of runs written before the sections).
"""

from __future__ import annotations

import json
import tomllib
import types
import typing
from pathlib import Path

from dflash.config.options import OPTIONS, flatten
from dflash.errors import ConfigError

FORMATS = {".yaml": "YAML", ".yml": "YAML", ".json": "JSON", ".toml": "TOML"}


def _parse(path: Path) -> object:
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ConfigError(f"--config {path}: unknown format '{path.suffix}'; use .yaml, .yml, .json or .toml.")
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc}).") from exc
    try:
        if kind == "YAML":
            import yaml

            return yaml.safe_load(text) or {}
        if kind == "TOML":
            return tomllib.loads(text)
        return json.loads(text)
    except Exception as exc:  # yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError
        raise ConfigError(f"--config {path}: not valid {kind}: {exc}") from exc


def _base_type(tp):
    """(type, optional) of a field type: `X | None` -> (X, True)."""
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return [a for a in args if a is not type(None)][0], type(None) in args
    return tp, False


def _convert(value, tp, where: str):
    base, optional = _base_type(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where} is empty; give a value or leave the key out.")
    bad = ConfigError(f"{where} is {value!r}; it must be {getattr(base, '__name__', str(base))}.")
    if typing.get_origin(base) is list:
        (item,) = typing.get_args(base)
        if isinstance(value, str):
            value = [v for v in value.replace(" ", "").split(",") if v]
        if not isinstance(value, list):
            raise bad
        return [_convert(v, item, where) for v in value]
    if base is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if base in (int, float):
        if isinstance(value, bool):
            raise bad
        if isinstance(value, str):
            try:
                value = base(value)
            except ValueError:
                raise bad from None
        if base is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, (int, float)) or (base is int and not isinstance(value, int)):
            raise bad
        return base(value)
    if base is str and isinstance(value, str):
        return value
    raise bad


def read_config_file(path) -> dict:
    """{option name: value} of the options set in `path`, each converted to its option's type."""
    path = Path(path)
    data = _parse(path)
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: the file must hold a mapping of option: value, "
                          f"not a {type(data).__name__}.")
    where = f"--config {path}"
    return flatten(data, where, lambda name, key, value: _convert(value, OPTIONS[name][2], f"{where}: '{key}'"))
