"""The option table of `dflash-train`: every option by its unique name, with its section, field and type,
and the reading of {option: value} mappings that may group options in section tables.

Option names are unique across the sections of dflash.config.sections, so a flat mapping names every
value without its section; `flatten` also accepts `{section: {option: value}}` and dashes for
underscores, and fails on an unknown key, an option under the wrong section or an option given twice,
naming the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing

from dflash.config.sections import SECTIONS, flag
from dflash.errors import ConfigError


def _options() -> dict[str, tuple[str, dataclasses.Field, object]]:
    """option name -> (section, field, type), in --help order."""
    out = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert f.name not in out and f.name not in SECTIONS, f"option {f.name} is not unique"
            out[f.name] = (section, f, hints[f.name])
    return out


OPTIONS = _options()


def unknown_option(key: str, where: str, names=None) -> ConfigError:
    """The error for a key that names no option, with the closest option spelled as the key is
    (`block-sise` -> `block-size`, `block_sise` -> `block_size`)."""
    names = list(OPTIONS if names is None else names)
    spell = flag if "-" in str(key) else (lambda n: n)
    hint = difflib.get_close_matches(spell(str(key).split(".")[-1]), [spell(n) for n in names], n=1)
    return ConfigError(f"{where}: unknown option '{key}'."
                       + (f" Did you mean '{hint[0]}'?" if hint else " `dflash-train --help` lists them."))


def flatten(data: dict, where: str, convert=None) -> dict:
    """{option: value} of a mapping whose keys are options, or sections holding options (keys may use
    dashes: `block-size`). An unknown key, an option under the wrong section, or an option given twice (`lr`
    and `[optim] lr`: no value wins silently) fails naming the fix. `convert(option, key as written, value)`
    may check and convert each value."""
    convert = convert or (lambda _option, _key, value: value)
    flat: dict = {}
    written: dict[str, tuple[str, object]] = {}  # option -> (its key as written, its value), for a second one

    def put(option: str, key: str, value) -> None:
        if option in written:  # `lr` and `[optim] lr`, or `block-size` and `block_size`: neither may win silently
            first_key, first_value = written[option]
            raise ConfigError(f"{where}: '{option}' is set twice, as '{first_key}' = {first_value!r} and as "
                              f"'{key}' = {value!r}; keep one of them.")
        written[option] = (key, value)
        flat[option] = convert(option, key, value)

    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in SECTIONS and isinstance(value, dict):
            for inner, inner_value in value.items():
                option = str(inner).replace("-", "_")
                if option not in OPTIONS:
                    section_options = [n for n, (s, _f, _t) in OPTIONS.items() if s == name]
                    raise unknown_option(f"{key}.{inner}", where, section_options + list(OPTIONS))
                if OPTIONS[option][0] != name:
                    raise ConfigError(f"{where}: '{inner}' belongs to the [{OPTIONS[option][0]}] section, not "
                                      f"[{key}]; move it there or write it without a section.")
                put(option, f"{key}.{inner}", inner_value)
        elif name in OPTIONS:
            put(name, str(key), value)
        else:
            raise unknown_option(key, where)
    return flat


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


def convert_value(option: str, value, where: str):
    """`value` as option `option`'s type (numbers in strings converted as the command line would), or a
    ConfigError naming `where` and the type it must be."""
    return _convert(value, OPTIONS[option][2], where)
