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
