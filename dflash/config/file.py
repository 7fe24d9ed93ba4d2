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
`dflash-train --help`; an unknown key, an option under another section than its own, or one option given
twice (`lr` at the top and `lr` under [optim]: neither wins silently) fails and names the fix. Values are
checked against each option's type here (YAML reads `6e-4` as a string: numbers in strings are converted
as the command line would), and the whole config is checked by TrainConfig afterwards. A `drafters` list
(TOML: `[[drafters]]` tables) names several drafters trained on one target pass; dflash.config.drafters
reads it (`read_drafter_entries`), the other keys are read here. The run's resolved config is written to
<out>/config.json as always, so `--config <out>/config.json` repeats a run (also the flat config.json of
runs written before the sections).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from dflash.config.options import convert_value, flatten
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


def read_config_file(path) -> dict:
    """{option name: value} of the options set in `path`, each converted to its option's type."""
    path = Path(path)
    data = _parse(path)
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: the file must hold a mapping of option: value, "
                          f"not a {type(data).__name__}.")
    where = f"--config {path}"
    data = {k: v for k, v in data.items() if k != "drafters"}  # dflash.config.drafters reads those
    return flatten(data, where, lambda name, key, value: convert_value(name, value, f"{where}: '{key}'"))


def read_drafter_entries(path) -> list | None:
    """The raw `drafters` list of the config file `path` (None when it has none); dflash.config.drafters
    checks and converts it."""
    path = Path(path)
    data = _parse(path)
    return data.get("drafters") if isinstance(data, dict) else None
