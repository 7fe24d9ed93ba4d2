"""The docs as a reader meets them: the README within its cap, and only names that exist.

The README stays a front page of at most 250 lines; the detail lives in docs/ and is linked.

Every dotted name of one of the project's packages (`dflash.batching.shares`, `images.build.build_wheels`,
`wheelbuilder.lock.lock_all`, ...) in README.md, docs/*.md and the packages' docstrings and comments must
resolve: the longest importable module prefix, then attributes (a dataclass field counts as one). A file
name (`dflash/cli.py`) is not a dotted name; names of other projects' packages are not checked.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("dflash", "images", "wheelbuilder", "common", "bench", "loopback")
DOTTED = re.compile(r"(?<![\w./-])((?:%s)(?:\.[A-Za-z_]\w*)+)" % "|".join(PACKAGES))
FILE_SUFFIXES = (".py", ".md", ".toml", ".json", ".jsonl", ".txt", ".log", ".sh")


def _texts():
    """(file, text) for each Markdown document and each package module (its docstrings and comments)."""
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        yield path, path.read_text()
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            source = path.read_text()
            docs = [ast.get_docstring(node, clean=False) or "" for node in ast.walk(ast.parse(source))
                    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
            comments = [line.split("#", 1)[1] for line in source.splitlines() if "#" in line]
            yield path, "\n".join(docs + comments)


def _has(obj, name: str) -> bool:
    if hasattr(obj, name):
        return True
    return dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}


def resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and (module == e.name or module.startswith(e.name + ".")):
                continue  # this prefix is no module: try a shorter one
            raise
        for attr in parts[cut:]:
            if not _has(obj, attr):
                return False
            obj = getattr(obj, attr, None)
        return True
    return False


def test_every_dotted_name_in_the_docs_and_docstrings_exists():
    missing: dict[str, set[str]] = {}
    for path, text in _texts():
        for match in DOTTED.finditer(text):
            name = match.group(1).rstrip(".")
            if not name.endswith(FILE_SUFFIXES) and not resolves(name):
                missing.setdefault(name, set()).add(str(path.relative_to(REPO)))
    assert not missing, "names that do not exist: " + "; ".join(f"{n} (in {', '.join(sorted(f))})"
                                                                 for n, f in sorted(missing.items()))


def test_the_resolver_tells_a_stale_name_from_a_real_one():
    assert resolves("dflash.batching.shares") and resolves("dflash.data.spans.tokenize_conversation")
    assert resolves("dflash.kinds.kind.DrafterKind.own_keys")  # a dataclass field
    assert not resolves("dflash.spans") and not resolves("dflash.data.tokenize_conversation")
    assert not resolves("dflash.train.trainer.no_such_function")


def test_readme_stays_within_250_lines():
    n = len((REPO / "README.md").read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines (at most 250: move the detail to a page in docs/ and link it)"
