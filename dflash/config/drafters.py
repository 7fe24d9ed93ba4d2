"""Several drafters trained on one target pass: the `drafters` list of a --config file, checked whole
before anything loads.

    # sweep.toml                              dflash-train --config sweep.toml
    target = "/models/Qwen3.5-27B"
    data = "data/regenerated.jsonl"
    out = "runs/sweep"                        each drafter writes runs/sweep/drafters/NAME/ (config.json,
    [optim]                                   metrics.jsonl, checkpoints/, drafter/, report/)
    lr = 6e-4                                 (the top level is every drafter's starting point)

    [[drafters]]
    name = "b16"                              a name: letters, digits, '-' and '_'
    [[drafters]]
    name = "b8-sw"
    block-size = 8                            options of this drafter alone, flat ...
    sliding-window = 2048
    [drafters.optim]                          ... or in section tables
    lr = 3e-4

Only options that leave the data order alone can differ between drafters (PER_DRAFTER): the drafter's
shape, tapped target layers (the one target pass taps their union: dflash.train.parallel.taps) and blocks, its loss
decay and its optimizer. The others are one value for the whole run (a drafter that names one fails,
saying why), since every drafter sees the same micro-batches in the same order.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from common.fsutil import atomic_write

from dflash.config.file import read_drafter_entries
from dflash.config.options import convert_value, flatten
from dflash.errors import ConfigError

# Options each drafter may set for itself.
PER_DRAFTER = frozenset({
    "block_size", "drafter_layers", "sliding_window", "target_layer_ids", "drafter_dtype", "max_anchors", "gamma",
    "lr", "weight_decay", "warmup_ratio", "grad_clip", "drafter_kind", "selector_missing",
})
# Why the options most likely to be tried cannot differ (the rest: "it is a setting of the whole run").
SHARED_BECAUSE = {
    "mask_token": "the one target pass and every drafter's blocks use the same mask token",
    "init_drafter": "its config.json fixes the tapped target layers and mask token of the one target pass",
    "max_length": "every drafter trains on the same tokenised sequences",
    "data": "every drafter trains on the same data", "target": "every drafter trains on the same target",
    "batch_size": "every drafter sees the same micro-batches", "max_tokens": "every drafter sees the same micro-batches",
    "packing": "every drafter sees the same micro-batches", "pack_tokens": "every drafter sees the same micro-batches",
    "pack_anchors": "every drafter's blocks come from the same packed rows",
    "grad_accum": "every drafter steps its optimizer after the same micro-batches",
    "seed": "it fixes the data order every drafter shares (each drafter's own init and anchors follow it "
            "exactly as in a run of that drafter alone)",
    "epochs": "every drafter trains for the same steps", "max_steps": "every drafter trains for the same steps",
}
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
DRAFTERS_DIR = "drafters"
PLAN_FILE = "drafters.json"  # <out>/drafters/drafters.json: the list, for --resume


@dataclass(frozen=True)
class DrafterSpec:
    """One drafter of a several-drafter run: its name and the options it sets for itself (flat)."""

    name: str
    options: dict

    def to_dict(self) -> dict:
        return {"name": self.name, **self.options}


def parse_drafters(entries, where: str) -> list[DrafterSpec]:
    """Checked DrafterSpecs of a `drafters` list (mappings with a name and per-drafter options)."""
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where}: 'drafters' must be a non-empty list of tables, each with a name "
                          "(TOML: [[drafters]] name = \"b16\").")
    specs, seen = [], set()
    for i, entry in enumerate(entries):
        at = f"{where}: drafters[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{at} is a {type(entry).__name__}; each drafter is a table with a name.")
        entry = dict(entry)
        name = entry.pop("name", None)
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ConfigError(f"{at}: name is {name!r}; give each drafter a name of letters, digits, '-' and '_' "
                              "(it names its directory <out>/drafters/NAME).")
        if name in seen:
            raise ConfigError(f"{where}: two drafters are named '{name}'; each name must be unique.")
        seen.add(name)
        at = f"{where}: drafter '{name}'"
        options = flatten(entry, at, lambda option, key, value: convert_value(option, value, f"{at}: '{key}'"))
        for option in options:
            if option not in PER_DRAFTER:
                why = SHARED_BECAUSE.get(option, "it is a setting of the whole run")
                raise ConfigError(f"{at}: '{option}' cannot differ between drafters: {why}. Set it once at the "
                                  f"top level of the file (drafters may set: {', '.join(sorted(PER_DRAFTER))}).")
        specs.append(DrafterSpec(name, options))
    return specs


def read_drafters(path) -> list[DrafterSpec]:
    """The drafters a --config file lists ([] when it lists none)."""
    entries = read_drafter_entries(path)
    return [] if entries is None else parse_drafters(entries, f"--config {path}")


def drafter_out(out, name: str) -> Path:
    """Where drafter `name` of a run in `out` writes its files."""
    return Path(out) / DRAFTERS_DIR / name


def drafter_configs(base, specs: list[DrafterSpec]) -> dict:
    """{name: TrainConfig} of each drafter: the run's config with the drafter's options and its own --out;
    every config is checked here (a bad value names its drafter)."""
    out = {}
    for spec in specs:
        try:
            out[spec.name] = base.replace(**spec.options, out=str(drafter_out(base.io.out, spec.name)))
        except ConfigError as exc:
            raise ConfigError(f"drafter '{spec.name}': {exc}") from None
    return out


def write_plan(out, specs: list[DrafterSpec]) -> None:
    """<out>/drafters/drafters.json: the drafters of the run, read back by --resume."""
    path = Path(out) / DRAFTERS_DIR / PLAN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps([s.to_dict() for s in specs], indent=2) + "\n")


def read_plan(out) -> list[DrafterSpec]:
    """The drafters a run in `out` trains ([] for a run of one drafter)."""
    path = Path(out) / DRAFTERS_DIR / PLAN_FILE
    if not path.is_file():
        return []
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}. Restore it, or start the run again with --overwrite.") from exc
    return parse_drafters(entries, str(path))


def resolve_drafters(config_file: str | None, out: str, resume: bool) -> list[DrafterSpec]:
    """The drafters of a run: the --config file's, or with --resume the stored ones; with both, they must
    name the same drafters."""
    given = read_drafters(config_file) if config_file else []
    if not resume:
        return given
    stored = read_plan(out)
    if given and [s.name for s in given] != [s.name for s in stored]:
        raise ConfigError(f"--resume: the run in {out} trains drafters {[s.name for s in stored] or 'one drafter'}, "
                          f"--config lists {[s.name for s in given]}; resume with the same list (or drop the "
                          "drafters from --config).")
    return given or stored

