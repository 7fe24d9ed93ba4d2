"""The registry of drafter kinds: what `--drafter-kind` takes, and the one place that tells kinds apart.

Each kind (dflash.kinds.kind.DrafterKind) lives in a folder of its own (dflash.kinds.dflash,
dflash.kinds.dflash2: its registration, its model and objective where they are its own, its remote code);
the rest of the code asks the kind of a config or a drafter (`kind_of`) or of a name (`named`) and calls
what it declares. A new kind is one folder beside dflash/ and one line in KINDS.
"""

from __future__ import annotations

from dflash.errors import ConfigError
from dflash.kinds.dflash2 import KIND as DFLASH2
from dflash.kinds.dflash import KIND as DFLASH
from dflash.kinds.kind import DrafterKind

KINDS: dict[str, DrafterKind] = {k.name: k for k in (DFLASH, DFLASH2)}
DEFAULT = DFLASH.name


def names() -> tuple[str, ...]:
    return tuple(KINDS)


def named(name: str) -> DrafterKind:
    """The kind `--drafter-kind name` asks for, or a ConfigError listing the kinds there are."""
    if name not in KINDS:
        raise ConfigError(f"--drafter-kind is '{name}'; choose one of {', '.join(KINDS)}.")
    return KINDS[name]


def kind_of(thing) -> DrafterKind:
    """The kind of a drafter config, a drafter module (also inside a DDP wrapper) or either's class: the kind
    whose config or model class is the nearest in its class's method resolution order."""
    thing = getattr(thing, "module", thing)
    cls = thing if isinstance(thing, type) else type(thing)
    for base in cls.__mro__:
        for kind in KINDS.values():
            if base in (kind.config_class, kind.model_class):
                return kind
    raise TypeError(f"{cls.__name__} is no drafter config or drafter of a known kind ({', '.join(KINDS)})")


def by_architecture(architectures: list) -> DrafterKind | None:
    """The kind whose config.json architecture is among `architectures`, or None."""
    return next((k for k in KINDS.values() if k.architecture in architectures), None)


def check_kind(config, name: str, where: str) -> None:
    """A ConfigError unless `config` (an existing drafter's, at `where`) is of the kind `name`."""
    found = kind_of(config).name
    if found != name:
        raise ConfigError(f"{where} is a {found} drafter and --drafter-kind is {name}; pass --drafter-kind {found}.")


def build_drafter(config, attention: str = "sdpa"):
    """The drafter module of `config`'s kind."""
    return kind_of(config).build(config, attention)
