"""TrainConfig: every option of `dflash-train`, each with its default and help text, in one place.

TrainConfig composes one small frozen dataclass per section (dflash.config.sections: io, model, optim,
runtime, watch, demo), each owning its fields, their defaults, help texts and its own checks; TrainConfig
adds the checks across sections. Read an option as `config.optim.lr`, `config.model.block_size`.

The command line is generated from the sections (`add_arguments` / `from_args`): one kebab-case flag per
field, one --help group per section. Option names are unique across sections, so flat mappings of
{option: value} name every value without its section: the flags, a --config file (which may also
group them in section tables, `[optim] lr = 3e-4`), and `TrainConfig.from_flat(lr=..., out=...)`. A run
writes its config as nested JSON, one object per section (`to_json`), and `--resume` reads it back
(`from_json`, which also reads the flat JSON of runs written before the sections existed).

Precedence (lowest first): field defaults < the demo's defaults (only when neither the file nor the
flags give --target/--data) < the config stored in the output dir (only with --resume) < the --config
file (YAML, JSON or TOML: dflash.config.file) < flags given on the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from common.fsutil import atomic_write

from dflash import batching
from dflash.config.layout import LAYOUTS, Layout
from dflash.config.sections import (SECTIONS, TRACKERS, DemoConfig, IOConfig, ModelConfig, OptimConfig,
                                    RuntimeConfig, WatchConfig, check_report_to, flag)
from dflash.config.file import read_config_file
from dflash.config.options import OPTIONS, convert_value, flatten, unknown_option
from dflash.errors import ConfigError

__all__ = ["TrainConfig", "IOConfig", "ModelConfig", "OptimConfig", "RuntimeConfig", "WatchConfig", "DemoConfig",
           "LAYOUTS", "Layout", "SECTIONS", "TRACKERS", "OPTIONS", "DEMO_DEFAULTS", "check_report_to", "add_arguments", "from_args"]


@dataclass(frozen=True)
class TrainConfig:
    """Options of one drafter training run, by section (units in the help strings)."""

    io: IOConfig = field(default_factory=IOConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    watch: WatchConfig = field(default_factory=WatchConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            section = getattr(self, name)
            if not isinstance(section, cls):
                raise TypeError(f"TrainConfig.{name} must be a {cls.__name__}, not {type(section).__name__}")
        if self.optim.max_tokens < self.model.max_length:
            raise ConfigError(f"--max-tokens {self.optim.max_tokens} is below --max-length {self.model.max_length}: "
                              "a full-length sequence would fit in no micro-batch. Raise --max-tokens.")
        if self.runtime.recompute_layers > self.model.drafter_layers:
            raise ConfigError(f"--recompute-layers {self.runtime.recompute_layers} is more than the drafter's "
                              f"{self.model.drafter_layers} layers (--drafter-layers); pass "
                              f"--recompute-layers {self.model.drafter_layers} or fewer.")
        batching.check_named(self)

    # --- derived ---------------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        """--layout, by what it does (dflash.config.layout)."""
        return Layout.of(self.runtime.layout)

    @property
    def is_demo(self) -> bool:
        return self.io.target is None and self.io.data is None

    # --- flat views ------------------------------------------------------------------------------
    @classmethod
    def from_flat(cls, values: dict | None = None, /, *, source: str = "config", **more) -> "TrainConfig":
        """A config from flat options (`from_flat(lr=1e-3, out="runs/x")`, or a dict of them); the rest
        take their defaults. An unknown name fails and names the closest option."""
        values = {**(values or {}), **more}
        by_section: dict[str, dict] = {name: {} for name in SECTIONS}
        for key, value in values.items():
            if key not in OPTIONS:
                raise unknown_option(key, source)
            by_section[OPTIONS[key][0]][key] = value
        return cls(**{name: SECTIONS[name](**kw) for name, kw in by_section.items()})

    def to_flat(self) -> dict:
        """{option: value} over all sections (the names of the flags, with underscores)."""
        return {name: getattr(getattr(self, section), name) for name, (section, _f, _t) in OPTIONS.items()}

    def replace(self, **changes) -> "TrainConfig":
        """A copy with some options changed, named flat (`config.replace(out=..., resume=True)`)."""
        return self.from_flat({**self.to_flat(), **changes})

    # --- JSON ------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Nested: {section: {option: value}}."""
        return dataclasses.asdict(self)

    def to_json(self, path: str | os.PathLike) -> None:
        """Write the resolved config atomically (fsynced temp file in the same dir, then rename)."""
        atomic_write(Path(path), json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_dict(cls, data: dict, *, source: str = "config") -> "TrainConfig":
        """From the nested form ({section: {option: value}}), the flat one ({option: value}: a config.json
        written before the sections), or a mix of both."""
        values = flatten(data, source, lambda name, key, value: convert_value(name, value, f"{source}: '{key}'"))
        return cls.from_flat(values, source=source)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "TrainConfig":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read the config {path}: {exc}. Delete it or point --out elsewhere.") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path} holds {type(data).__name__}, not a config; delete it or point --out elsewhere.")
        return cls.from_dict(data, source=str(path))


def is_run_config(data: object) -> bool:
    """Whether a parsed config.json is one that dflash-train wrote (nested, or flat as older runs did)."""
    return isinstance(data, dict) and (isinstance(data.get("model"), dict) and "block_size" in data["model"]
                                       or "block_size" in data)


# Settings of the built-in demo (tiny target, CPU-friendly); flags given on the command line win.
# cpu_threads=1: torch's default is one thread per core, and a CPU op split over threads adds its partial
# sums in another order (4 threads against 1: the gradient norm and some MLP weights differed in the last
# bits after 30 steps), so the drafter and its tau followed the machine's core count. One thread gives the
# same run on any number of cores, and on a small or busy machine it is also the fastest.
DEMO_DEFAULTS: dict = dict(
    block_size=8, drafter_layers=2, max_length=256, max_anchors=32, max_tokens=4096, batch_size=8,
    max_steps=300, epochs=0, lr=2e-3, log_every=25, save_every=100, cpu_threads=1,
)


# --- command line ----------------------------------------------------------------------------------
def _parse_int_list(text: str) -> list[int]:
    try:
        return [int(p) for p in text.replace(" ", "").split(",") if p]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers (e.g. 1,9,17)") from None


def _converter(tp):
    """argparse `type=` for a field type; `X | None` converts like X."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        tp = args[0]
    if typing.get_origin(tp) is list:
        return _parse_int_list if typing.get_args(tp) == (int,) else str
    return tp


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One kebab-case flag per option, with its help and default, in one --help group per section.

    Flags default to SUPPRESS so that `from_args` can tell given flags from defaults (needed for the
    precedence rules above); the help text prints the real default.
    """
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="options from a .yaml, .json or .toml file (keys as the flags below); flags given "
                             "on the command line override the file")
    for cls in SECTIONS.values():
        group = parser.add_argument_group(cls.TITLE)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp, default = hints[f.name], f.default
            shown = ",".join(map(str, default)) if isinstance(default, list) else default
            help_text = f.metadata["help"]
            if "(default:" not in help_text:  # a help text may say the default in words: print it once
                help_text += f" (default: {shown})"
            kwargs = dict(help=help_text, default=argparse.SUPPRESS, dest=f.name)
            if tp is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = _converter(tp)
                kwargs["metavar"] = f.name.upper()
                if f.metadata.get("nargs"):
                    kwargs["nargs"] = f.metadata["nargs"]
                if f.metadata.get("choices"):
                    kwargs["choices"] = f.metadata["choices"]
                    kwargs.pop("metavar")
            group.add_argument(f"--{flag(f.name)}", **kwargs)


def from_args(ns: argparse.Namespace, read_stored=None) -> TrainConfig:
    """Resolve a TrainConfig from parsed flags, applying the precedence in the module docstring.

    `read_stored(out)` returns the config a run stored in its output dir, for --resume (the run directory's
    layout is the trainer's: dflash.train.records.rundir.read_stored_config; dflash.cli.train_config passes it).
    """
    given = {name: getattr(ns, name) for name in OPTIONS if hasattr(ns, name)}
    if getattr(ns, "config", None):
        given = {**read_config_file(ns.config), **given}
    values: dict = {}
    if "target" not in given and "data" not in given:
        values.update(DEMO_DEFAULTS)
    if given.get("resume"):
        if read_stored is None:
            raise TypeError("from_args: --resume needs read_stored (dflash.train.records.rundir.read_stored_config)")
        # the stored run may have started with --overwrite: continuing it deletes nothing
        values = {**read_stored(given.get("out", IOConfig.out)).to_flat(), "overwrite": False}
    values.update(given)
    return TrainConfig.from_flat(values, source="command line")
