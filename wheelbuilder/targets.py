"""targets.toml: the single source of truth, loaded into frozen dataclasses and checked up front.

Everything that can be wrong in the file (an unknown key, a target naming a missing toolkit, an arch
the toolkit's CUDA cannot compile) fails here, before anything is downloaded or compiled.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from .errors import ConfigurationError
from common.fsutil import REPO_ROOT

# A checkout's own targets.toml; an installed copy (the runtime image) points here with DFLASH_TARGETS_FILE.
DEFAULT_TARGETS_FILE = Path(os.environ.get("DFLASH_TARGETS_FILE", REPO_ROOT / "targets.toml"))

# First CUDA release whose nvcc compiles SASS for each arch (NVIDIA's CUDA release notes). All of them
# still compile with CUDA 13, which dropped only arches before Turing (7.5), so no upper bound is kept.
ARCH_MIN_CUDA: dict[str, str] = {
    "7.5": "10.0", "8.0": "11.0", "8.6": "11.1", "8.7": "11.4", "8.9": "11.8", "9.0": "11.8",
    "10.0": "12.8", "10.3": "12.9", "11.0": "13.0", "12.0": "12.8", "12.1": "12.9",
}
PYPI_INDEX = "https://pypi.org/simple"


def did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" Did you mean '{close[0]}'?" if close else ""


@dataclass(frozen=True, order=True)
class Arch:
    """A GPU arch as `major.minor`, optionally with PTX (`12.0+PTX`)."""

    major: int
    minor: int
    ptx: bool = False

    @classmethod
    def parse(cls, text: str) -> "Arch":
        m = re.fullmatch(r"(\d+)\.(\d)(\+PTX)?", text.strip(), flags=re.IGNORECASE)
        if not m:
            raise ConfigurationError(
                f"arch '{text}' is not of the form MAJOR.MINOR or MAJOR.MINOR+PTX (e.g. 12.0, 9.0+PTX)."
            )
        arch = cls(int(m.group(1)), int(m.group(2)), bool(m.group(3)))
        if arch.name not in ARCH_MIN_CUDA:
            raise ConfigurationError(
                f"arch '{text}' is not a GPU arch this builder knows (known: {', '.join(ARCH_MIN_CUDA)})."
                + did_you_mean(arch.name, ARCH_MIN_CUDA)
            )
        return arch

    @property
    def name(self) -> str:
        return f"{self.major}.{self.minor}"

    @property
    def sm(self) -> int:
        """The number nvcc and the fatbin use: 12.0 -> 120."""
        return self.major * 10 + self.minor

    def __str__(self) -> str:
        return self.name + ("+PTX" if self.ptx else "")

    def gencode_flags(self) -> list[str]:
        """nvcc flags: SASS for this arch, plus PTX when asked (JIT to later GPUs)."""
        flags = ["-gencode", f"arch=compute_{self.sm},code=sm_{self.sm}"]
        if self.ptx:
            flags += ["-gencode", f"arch=compute_{self.sm},code=compute_{self.sm}"]
        return flags

    def min_cuda(self) -> Version:
        return Version(ARCH_MIN_CUDA[self.name])


@dataclass(frozen=True)
class ToolkitSpec:
    """A [toolkits.*] table of targets.toml: where a target's nvcc comes from, as declared (what is
    found on a machine is toolkit.DetectedToolchain)."""

    name: str
    kind: str  # "image" (CUDA devel image) or "pypi" (NVIDIA's wheels on a Debian base)
    cuda: Version
    builder_base: str
    runtime_base: str
    python: str
    packages: tuple[str, ...] = ()
    image: str = ""  # kind "image": the devel image (registry tag) nvcc is copied from

    @property
    def image_cuda_home(self) -> str:
        """Where the devel image keeps this CUDA release (/usr/local/cuda-12.8)."""
        return f"/usr/local/cuda-{self.cuda.major}.{self.cuda.minor}"


@dataclass(frozen=True)
class TorchPin:
    name: str
    version: str  # exact, local label included (2.11.0+cu128)
    cuda: Version
    index: str
    lock: str  # folder under locks/
    cxx_standard: str = "c++17"  # what its C++ extensions compile as ("c++20" from torch 2.13)

    @property
    def from_pypi(self) -> bool:
        """Lockable with PyPI alone (plain `make lock`); other indexes are locked only when named."""
        return self.index.rstrip("/") == PYPI_INDEX

    @property
    def minor(self) -> str:
        """'2.11': the ABI a C++ extension is tied to."""
        v = Version(self.version)
        return f"{v.major}.{v.minor}"

    @property
    def public(self) -> str:
        return Version(self.version).public


@dataclass(frozen=True)
class ArchPatch:
    file: str
    variable: str
    anchor: str


@dataclass(frozen=True)
class Replacement:
    file: str
    old: str
    new: str
    count: int = 1


@dataclass(frozen=True)
class Recipe:
    """How to build one CUDA extension from its pinned sdist (pure data)."""

    key: str
    name: str
    version: str
    sdist: str
    url: str
    sha256: str
    modules: tuple[str, ...]
    import_check: str
    env: tuple[tuple[str, str], ...]
    arch_patch: ArchPatch | None
    replace: tuple[Replacement, ...] = ()
    upstream_arches: tuple[Arch, ...] = ()
    source: str = field(default="targets.toml", compare=False)  # the file it was read from (for messages)

    @property
    def dist_name(self) -> str:
        """The wheel's distribution name (PEP 427 escaping)."""
        return re.sub(r"[-_.]+", "_", self.name).lower()


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    toolkit: ToolkitSpec
    torch: TorchPin
    arches: tuple[Arch, ...]
    recipes: tuple[Recipe, ...]
    source: str = field(default="targets.toml", compare=False)  # the file it was read from (for messages)

    @property
    def python(self) -> str:
        return self.toolkit.python

    @property
    def cp_tag(self) -> str:
        return "cp" + self.python.replace(".", "")

    def local_version(self) -> str:
        """The wheel's local version label: CUDA, torch and arches, e.g. cu130torch2.11sm120."""
        cuda = f"cu{self.torch.cuda.major}{self.torch.cuda.minor}"
        arches = "".join(f"sm{a.sm}" + ("ptx" if a.ptx else "") for a in self.arches)
        return f"{cuda}torch{self.torch.minor}{arches}"


@dataclass(frozen=True)
class Catalog:
    path: Path
    default_target: str
    targets: dict[str, Target] = field(default_factory=dict)

    def target(self, name: str | None) -> Target:
        name = name or self.default_target
        if name not in self.targets:
            raise ConfigurationError(
                f"unknown target '{name}'." + did_you_mean(name, self.targets)
                + f" Targets in {self.path.name}: {', '.join(sorted(self.targets))}."
            )
        return self.targets[name]


def _check_keys(table: dict, allowed: set[str], where: str) -> None:
    for key in table:
        if key not in allowed:
            raise ConfigurationError(
                f"{where}: unknown key '{key}'." + did_you_mean(key, allowed)
                + f" Allowed: {', '.join(sorted(allowed))}."
            )


def _need(table: dict, key: str, where: str):
    if key not in table:
        raise ConfigurationError(f"{where}: missing required key '{key}'.")
    return table[key]


def _version(text: str, where: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise ConfigurationError(f"{where}: '{text}' is not a version.") from None


def _load_recipe(key: str, t: dict, source: str) -> Recipe:
    where = f"[recipes.{key}]"
    _check_keys(t, {"name", "version", "sdist", "url", "sha256", "modules", "import_check", "env",
                    "arch_patch", "replace", "upstream_arches"}, where)
    sha = _need(t, "sha256", where)
    if not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise ConfigurationError(f"{where}: sha256 '{sha}' is not 64 lowercase hex digits.")
    patch = None
    if "arch_patch" in t:
        _check_keys(t["arch_patch"], {"file", "variable", "anchor"}, f"{where}.arch_patch")
        patch = ArchPatch(**t["arch_patch"])
    replace = []
    for i, r in enumerate(t.get("replace", [])):
        _check_keys(r, {"file", "old", "new", "count"}, f"{where}.replace[{i}]")
        replace.append(Replacement(**r))
    return Recipe(
        key=key,
        name=_need(t, "name", where),
        version=_need(t, "version", where),
        sdist=_need(t, "sdist", where),
        url=_need(t, "url", where),
        sha256=sha,
        modules=tuple(_need(t, "modules", where)),
        import_check=t.get("import_check", _need(t, "modules", where)[0]),
        env=tuple(sorted((str(k), str(v)) for k, v in t.get("env", {}).items())),
        arch_patch=patch,
        replace=tuple(replace),
        upstream_arches=tuple(Arch.parse(a) for a in t.get("upstream_arches", [])),
        source=source,
    )


def load(path: Path | str | None = None) -> Catalog:
    """Load and validate targets.toml; every error names the table and key at fault."""
    path = Path(path or DEFAULT_TARGETS_FILE)
    try:
        return _load(path)
    except ConfigurationError as e:  # every message names the file: it need not be the repository's
        if str(path) in str(e):
            raise
        raise ConfigurationError(f"{path}: {e}") from None
    except (TypeError, AttributeError, KeyError, ValueError) as e:  # a value of the wrong type or shape
        raise ConfigurationError(
            f"{path}: a table or value has the wrong type or misses a key ({type(e).__name__}: {e}). Compare the "
            "file with the layout in the repository's targets.toml (tables of strings, lists of strings)."
        ) from None


def _read_toml(path: Path) -> dict:
    """The parsed targets file; a missing, unreadable or malformed one is a ConfigurationError saying which."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigurationError(f"targets file {path} does not exist.") from None
    except IsADirectoryError:
        raise ConfigurationError(f"targets file {path} is a directory; --targets-file takes a TOML file "
                                 f"(e.g. {path / 'targets.toml'}, if that is the one meant).") from None
    except OSError as e:  # unreadable: permissions, a FIFO, an I/O error
        raise ConfigurationError(f"targets file {path} cannot be read ({e.strerror or e}).") from None
    except UnicodeDecodeError as e:
        raise ConfigurationError(f"{path}: not a UTF-8 text file ({e}); --targets-file takes a TOML file.") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigurationError(f"{path}: not valid TOML: {e}.") from None


def _load_toolkit(name: str, t: dict) -> ToolkitSpec:
    """One [toolkits.NAME] table, its kind 'image' or 'pypi'."""
    where = f"[toolkits.{name}]"
    _check_keys(t, {"kind", "cuda", "builder_base", "runtime_base", "python", "packages", "image"}, where)
    kind = _need(t, "kind", where)
    if kind not in ("image", "pypi"):
        raise ConfigurationError(f"{where}: kind must be 'image' or 'pypi', not '{kind}'.")
    return ToolkitSpec(
        name=name, kind=kind, cuda=_version(_need(t, "cuda", where), where),
        builder_base=_need(t, "builder_base", where), runtime_base=_need(t, "runtime_base", where),
        python=_need(t, "python", where), packages=tuple(t.get("packages", ())),
        image=_toolkit_image(t, kind, where),
    )


def _load_torch(name: str, t: dict) -> TorchPin:
    """One [torch.NAME] table."""
    where = f"[torch.{name}]"
    _check_keys(t, {"version", "cuda", "index", "lock", "cxx_standard"}, where)
    return TorchPin(
        name=name, version=_need(t, "version", where),
        cuda=_version(_need(t, "cuda", where), where), index=_need(t, "index", where),
        lock=_need(t, "lock", where), cxx_standard=_cxx_standard(t, where),
    )


def _load_target(name: str, t: dict, toolkits: dict[str, ToolkitSpec], torches: dict[str, TorchPin],
                 recipes: dict[str, Recipe], source: str) -> Target:
    """One [targets.NAME] table: its toolkit, torch and recipes defined, its arches ones that toolkit compiles."""
    where = f"[targets.{name}]"
    _check_keys(t, {"description", "toolkit", "torch", "arches", "recipes"}, where)
    tk_name, torch_name = _need(t, "toolkit", where), _need(t, "torch", where)
    if tk_name not in toolkits:
        raise ConfigurationError(f"{where}: toolkit '{tk_name}' is not defined." + did_you_mean(tk_name, toolkits))
    if torch_name not in torches:
        raise ConfigurationError(f"{where}: torch '{torch_name}' is not defined." + did_you_mean(torch_name, torches))
    toolkit, torch = toolkits[tk_name], torches[torch_name]
    arches = tuple(Arch.parse(a) for a in _need(t, "arches", where))
    if not arches:
        raise ConfigurationError(f"{where}: arches is empty; name at least one (e.g. \"12.0\").")
    check_unique_arches(arches, where)
    check_arches_compilable(arches, toolkit.cuda, where)
    if toolkit.cuda.major != torch.cuda.major:
        raise ConfigurationError(
            f"{where}: toolkit CUDA {toolkit.cuda} and torch {torch.version} (CUDA {torch.cuda}) differ in "
            "major version; torch.utils.cpp_extension refuses that. Pair a toolkit and a torch of one CUDA major."
        )
    missing = [r for r in _need(t, "recipes", where) if r not in recipes]
    if missing:
        raise ConfigurationError(f"{where}: recipe '{missing[0]}' is not defined." + did_you_mean(missing[0], recipes))
    return Target(
        name=name, description=t.get("description", ""), toolkit=toolkit, torch=torch,
        arches=arches, recipes=tuple(recipes[r] for r in t["recipes"]), source=source,
    )


def _load(path: Path) -> Catalog:
    data = _read_toml(path)
    _check_keys(data, {"default_target", "toolkits", "torch", "targets", "recipes"}, "top level")

    toolkits = {name: _load_toolkit(name, t) for name, t in data.get("toolkits", {}).items()}
    torches = {name: _load_torch(name, t) for name, t in data.get("torch", {}).items()}
    recipes = {key: _load_recipe(key, t, str(path)) for key, t in data.get("recipes", {}).items()}
    targets = {name: _load_target(name, t, toolkits, torches, recipes, str(path))
               for name, t in data.get("targets", {}).items()}
    default = _need(data, "default_target", "top level")
    catalog = Catalog(path=path, default_target=default, targets=targets)
    catalog.target(default)  # the default must exist
    return catalog


CXX_STANDARDS = ("c++17", "c++20")


def _cxx_standard(t: dict, where: str) -> str:
    value = t.get("cxx_standard", "c++17")
    if value not in CXX_STANDARDS:
        raise ConfigurationError(f"{where}: cxx_standard '{value}' is not one of {', '.join(CXX_STANDARDS)} "
                                 "(torch < 2.13 builds extensions as c++17, 2.13 and later as c++20)."
                                 + did_you_mean(str(value), CXX_STANDARDS))
    return value


def _toolkit_image(t: dict, kind: str, where: str) -> str:
    """kind "image" names its devel image by tag; the digest is data that `make pin-images` records in
    locks/images.toml, so it is never written here by hand."""
    if kind != "image":
        if "image" in t:
            raise ConfigurationError(f"{where}: 'image' is only for kind = \"image\" (nvcc from a devel image); "
                                     f"a {kind} toolkit takes nvcc from its packages.")
        return ""
    image = _need(t, "image", where)
    if "@" in image or ":" not in image.rsplit("/", 1)[-1]:
        raise ConfigurationError(
            f"{where}: image '{image}' must be a tag reference like nvidia/cuda:12.8.1-devel-ubuntu24.04, "
            "without '@sha256:'. Its digest lives in locks/images.toml: record it with `make pin-images`."
        )
    return image


def check_unique_arches(arches, where: str) -> None:
    """Each arch once: `12.0,12.0` would build the same code twice and name the wheel `sm120sm120`."""
    seen: dict[str, Arch] = {}
    for a in arches:
        if a.name in seen:
            raise ConfigurationError(
                f"{where}: arch {a.name} is named twice ({seen[a.name]} and {a}); name each arch once, "
                f"with +PTX on the one entry that should also carry PTX (e.g. {a.name}+PTX)."
            )
        seen[a.name] = a


def check_arches_compilable(arches, cuda: Version, where: str) -> None:
    """Refuse an arch the toolkit's nvcc cannot compile (SM 12.0 needs CUDA >= 12.8)."""
    for a in arches:
        if Version(f"{cuda.major}.{cuda.minor}") < a.min_cuda():
            raise ConfigurationError(
                f"{where}: arch {a} needs CUDA >= {a.min_cuda()}, but the toolkit is CUDA {cuda}. "
                "Use a newer toolkit, or drop the arch."
            )
