"""Typed values of a drafter's config.json: each one converted, or a DrafterError naming the key and the
value it must be (dflash.io.drafter_dir and each drafter kind, dflash.kinds, read every key through these)."""

from __future__ import annotations

import math
from pathlib import Path

from dflash.errors import DrafterError


def as_int(value, key: str, where: Path, minimum: int | None = None) -> int:
    """`value` of config key `key` as an int (a JSON integer, an integral float or a numeric string), at least
    `minimum`; anything else is a DrafterError naming the key."""
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            pass
    if number is None or (minimum is not None and number < minimum):
        need = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise DrafterError(f"{where}: {key} is {value!r}; it must be {need}")
    return number


def as_float(value, key: str, where: Path, positive: bool = False) -> float:
    """`value` of config key `key` as a finite float (> 0 with `positive`: an RMSNorm epsilon, a RoPE base);
    anything else is a DrafterError naming the key."""
    if not isinstance(value, bool) and isinstance(value, (int, float, str)):
        try:
            number = float(value)
        except (ValueError, OverflowError):
            pass
        else:
            if math.isfinite(number) and (number > 0 or not positive):
                return number
    need = "a finite number > 0" if positive else "a finite number"
    raise DrafterError(f"{where}: {key} is {value!r}; it must be {need}")


def as_int_list(value, key: str, where: Path) -> list[int]:
    if not isinstance(value, list):
        raise DrafterError(f"{where}: {key} is {value!r}; it must be a list of integers, e.g. [1, 9, 17]")
    return [as_int(v, key, where) for v in value]


def as_mapping(value, key: str, where: Path) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DrafterError(f"{where}: {key} is {value!r}; it must be a JSON object (or null)")
    return value
