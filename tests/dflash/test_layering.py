"""The package picture the README draws: inside dflash/ imports only go down the layers, and no module
outgrows one job (400 lines)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "dflash"
# lowest first; a sub-package may import its own layer and any layer before it, never one after it
LAYERS = [{"errors", "distributed"}, {"config"}, {"data", "model"}, {"io"}, {"regenerate"}, {"decode", "plan"},
          {"train"}, {"demo", "doctor"}, {"cli", "__main__", "launcher"}]
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


def test_module_names_are_unique_inside_dflash():
    """A module's name says its job: two modules of one name in different sub-packages read as one."""
    from collections import Counter

    names = Counter(p.name for p in MODULES if p.name not in ("__init__.py", "__main__.py"))
    repeated = {name: sorted(str(p.relative_to(ROOT)) for p in MODULES if p.name == name)
                for name, n in names.items() if n > 1}
    assert not repeated, f"module names repeated inside dflash/: {repeated}"
