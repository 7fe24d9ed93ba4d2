"""The package picture the README draws: inside dflash/ imports only go down the layers, and no module
outgrows one job (400 lines)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "dflash"
# lowest first; a sub-package may import its own layer and any layer before it, never one after it
LAYERS = [{"errors", "distributed"}, {"data", "model", "objective"}, {"kinds", "batching"}, {"io"}, {"config"}, {"regenerate"},
          {"decode", "plan"}, {"train"}, {"demo", "doctor"}, {"cli", "commands", "__main__", "launcher"}]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
MODULES = sorted(p for p in ROOT.rglob("*.py") if p.name != "__init__.py" or p.parent != ROOT)


def _part(path: Path) -> str:
    return path.relative_to(ROOT).parts[0].removesuffix(".py")


def _imported_parts(path: Path) -> set[str]:
    """The dflash sub-packages `path` imports, at module level or inside functions."""
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        parts |= {n.split(".")[1] for n in names if n.startswith("dflash.") and n.count(".") >= 1}
    return parts


def test_every_sub_package_has_a_layer():
    assert {_part(p) for p in MODULES} <= RANK.keys()


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_only_go_down(path):
    me = _part(path)
    upward = {part for part in _imported_parts(path) if part in RANK and RANK[part] > RANK[me]}
    assert not upward, f"{path.relative_to(ROOT)} ({me}) imports the higher layer(s) {sorted(upward)}"


def test_no_module_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in MODULES if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"modules over 400 lines: {long}"


def test_no_function_over_60_lines_in_the_packages():
    """A function longer than a screen does more than one thing: split it at the seams it has."""
    packages = [ROOT.parent / p for p in ("dflash", "images", "wheelbuilder", "common", "loopback")]
    long = {f"{path.relative_to(ROOT.parent)}: {node.name}": n
            for package in packages for path in sorted(package.rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (n := node.end_lineno - node.lineno + 1) > 60}
    assert not long, f"functions over 60 lines: {long}"


def test_cli_stays_within_300_lines():
    """cli.py only parses and dispatches; the smaller subcommands' parsers and handlers live in commands.py."""
    n = len((ROOT / "cli.py").read_text().splitlines())
    assert n <= 300, f"dflash/cli.py has {n} lines (at most 300: move a subcommand to dflash/commands.py)"


def _compared_names(path: Path, names: set[str]) -> list[str]:
    """String constants among `names` that `path` compares (==, !=, in, not in) or keys a dict with."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for side in sides:
                items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                found += [f"line {node.lineno}: {i.value!r}" for i in items
                          if isinstance(i, ast.Constant) and i.value in names]
        if isinstance(node, ast.Dict):
            found += [f"line {node.lineno}: {k.value!r} as a key" for k in node.keys
                      if isinstance(k, ast.Constant) and k.value in names]
    return found


def test_layout_names_are_told_apart_only_in_the_layout_module():
    """Everywhere else asks a Layout what it does (dflash.config.layout): a new layout is one entry there."""
    from dflash.config.layout import LAYOUTS

    home = ROOT / "config" / "layout.py"
    offenders = {str(p.relative_to(ROOT)): hits for p in MODULES if p != home
                 and (hits := _compared_names(p, set(LAYOUTS)))}
    assert not offenders, f"layout names compared outside dflash/config/layout.py: {offenders}"


def test_the_layout_check_finds_a_comparison(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('def f(layout):\n    return layout == "offload" or layout in ("shard", "x")\n')
    assert len(_compared_names(probe, {"offload", "shard"})) == 2


def _attributes_read(path: Path, names: set[str]) -> list[str]:
    """Where `path` reads an attribute named in `names` (`x.shards_drafter`), as 'line: name'."""
    return [f"{n.lineno}: {n.attr}" for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Attribute) and n.attr in names]


def test_only_the_drafter_state_asks_how_a_layout_keeps_the_drafter():
    """Training code asks dflash.train.parallel.drafter_state's classes (the group, the wrapper, the optimizer,
    the checkpoints, the whole drafter), never a Layout's facts about the drafter's state; the plan's cost
    models (dflash.plan) read them to count what each layout costs."""
    facts = {"shards_drafter", "state_on_host"}
    allowed = {ROOT / "config" / "layout.py", ROOT / "train" / "parallel" / "drafter_state.py"}
    offenders = {str(p.relative_to(ROOT)): hits for p in MODULES if p not in allowed and _part(p) != "plan"
                 and (hits := _attributes_read(p, facts))}
    assert not offenders, f"the drafter-state facts read outside drafter_state and the plan: {offenders}"


def test_the_fact_check_finds_a_read(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(config):\n    return config.layout.shards_drafter\n")
    assert _attributes_read(probe, {"shards_drafter"}) == ["2: shards_drafter"]


def test_module_names_are_unique_inside_dflash():
    """A module's name says its job: two modules of one name in different sub-packages read as one."""
    from collections import Counter

    names = Counter(p.name for p in MODULES if p.name not in ("__init__.py", "__main__.py"))
    repeated = {name: sorted(str(p.relative_to(ROOT)) for p in MODULES if p.name == name)
                for name, n in names.items() if n > 1}
    assert not repeated, f"module names repeated inside dflash/: {repeated}"


def _kind_uses(path: Path, names: set[str]) -> list[str]:
    """Where `path` tells drafter kinds apart by name: a kind name compared or keying a dict (as above), given
    as a choice, or bound to a name, parameter or keyword that says "kind"."""
    found = _compared_names(path, names)
    for node in ast.walk(ast.parse(path.read_text())):
        bound = []
        if isinstance(node, ast.keyword) and node.arg and ("kind" in node.arg or node.arg == "choices"):
            bound = [node.value]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any("kind" in ast.unparse(t).lower() for t in targets) and node.value is not None:
                bound = [node.value]
        elif isinstance(node, ast.arguments):
            params = [*node.posonlyargs, *node.args]
            bound = [d for p, d in zip(params[len(params) - len(node.defaults):], node.defaults) if "kind" in p.arg]
            bound += [d for p, d in zip(node.kwonlyargs, node.kw_defaults) if d is not None and "kind" in p.arg]
        for value in bound:
            items = value.elts if isinstance(value, (ast.Tuple, ast.List, ast.Set)) else [value]
            found += [f"line {value.lineno}: {i.value!r}" for i in items if isinstance(i, ast.Constant) and i.value in names]
    return found


def test_drafter_kind_names_appear_only_in_their_own_modules_and_the_registry():
    """Everywhere else asks a DrafterKind (dflash.kinds): a new kind is one folder and one registry line."""
    from dflash.kinds import KINDS

    home = ROOT / "kinds"
    offenders = {str(p.relative_to(ROOT)): hits for p in MODULES if home not in p.parents
                 and (hits := _kind_uses(p, set(KINDS)))}
    assert not offenders, f"drafter kind names told apart outside dflash/kinds/: {offenders}"


def test_the_kind_check_finds_each_way_of_naming_a_kind(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('def f(c, kind="dflash2"):\n    drafter_kind = "dflash"\n    x = {"dflash": 1}\n'
                     '    opt(choices=("dflash", "dflash2"))\n    g(kind="dflash2")\n    return c.kind == "dflash2"\n'
                     'logging.getLogger("dflash")\n')
    assert len(_kind_uses(probe, {"dflash", "dflash2"})) == 7


def test_kind_classes_are_asked_for_only_in_their_own_modules():
    """No isinstance or type test on a kind's own config or model class (not the base every kind shares) outside
    dflash/model (where each class checks its own) and dflash/kinds: the rest asks dflash.kinds.kind_of."""
    from dflash.kinds import KINDS

    classes = set()
    for role in ("config_class", "model_class"):
        own = [getattr(k, role) for k in KINDS.values()]
        classes |= {c.__name__ for c in own if not all(issubclass(o, c) for o in own)}  # not every kind's base
    offenders = {}
    for path in MODULES:
        if (ROOT / "kinds") in path.parents or (ROOT / "model") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("isinstance", "issubclass", "type"):
                named = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & classes
                if named:
                    offenders.setdefault(str(path.relative_to(ROOT)), []).append(f"line {node.lineno}: {sorted(named)}")
    assert not offenders, f"kind classes tested outside their modules: {offenders}"


def _batching_asks(path: Path, names: set[str], classes: set[str]) -> list[str]:
    """Where `path` asks which batching a run uses: reads --packing (`.packing`), compares a batching's name or
    flag, or names a batching class."""
    found = _compared_names(path, names)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "packing":
            found.append(f"line {node.lineno}: .packing")
        if isinstance(node, (ast.Name, ast.alias)) and (node.id if isinstance(node, ast.Name) else node.name) in classes:
            found.append(f"line {node.lineno}: {getattr(node, 'id', None) or node.name}")
    return found


def test_only_the_batching_package_asks_which_batching_a_run_uses():
    """Everywhere else asks the run's Batching (dflash.batching): a third batching is one class and one line."""
    from dflash.batching import BATCHINGS

    home = ROOT / "batching"
    names = {cls.name for cls in BATCHINGS.values()} | {"packed", "padded"}
    classes = {cls.__name__ for cls in BATCHINGS.values()}
    offenders = {str(p.relative_to(ROOT)): hits for p in MODULES if home not in p.parents
                 and (hits := _batching_asks(p, names, classes))}
    assert not offenders, f"which batching a run uses, asked outside dflash/batching/: {offenders}"


def test_the_batching_check_finds_each_way_of_asking(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('from dflash.batching.packed import Packed\n'
                     'def f(config, b):\n    on = config.optim.packing == "on"\n'
                     '    return b.name == "packed" or isinstance(b, Packed)\n')
    assert len(_batching_asks(probe, {"packed", "padded"}, {"Packed", "Padded"})) == 4


def _kind_folder(module: str) -> str | None:
    """The kind folder (dflash/kinds/<kind>/) a dotted module name lies in, or None."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["dflash", "kinds"] and (ROOT / "kinds" / parts[2]).is_dir() \
        else None


def test_each_kind_folder_imports_only_its_own_folder_and_below():
    """A drafter kind's folder (dflash/kinds/<kind>/: its model, objective, remote code and registration) imports
    its own modules, the pieces every kind shares (dflash.kinds.kind, dflash.kinds.config_values, dflash.model,
    dflash.objective) and lower layers; never another kind's folder, never the registry above it."""
    offenders = {}
    for folder in sorted(p for p in (ROOT / "kinds").iterdir() if p.is_dir() and (p / "__init__.py").is_file()):
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                    [a.name for a in node.names] if isinstance(node, ast.Import) else []
                bad = [n for n in names if n == "dflash.kinds" or (_kind_folder(n) not in (None, folder.name))]
                if bad:
                    offenders.setdefault(str(path.relative_to(ROOT)), []).extend(bad)
    assert not offenders, f"kind folders importing another kind or the registry: {offenders}"
