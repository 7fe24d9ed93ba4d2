"""Which C++ standard a compile really used, checked against what the target's torch needs.

torch >= 2.13 builds C++ extensions as C++20 (its headers need it), older torch as C++17
([torch.*].cxx_standard in targets.toml). torch.utils.cpp_extension adds the flag itself unless the
extension's setup.py already passes a `-std=`, and nvcc refuses two of them; so a recipe that hard-codes
`-std=c++17` compiles against torch 2.13+ only with the wrong standard, or not at all. After the compile
the build reads the `-std=` flags torch wrote into build.ninja (host compiler and nvcc lines) and stops
unless every one is the target's standard.
"""

from __future__ import annotations

import re
from pathlib import Path

from .errors import BuildError
from .targets import Recipe, Target

FLAG_LINES = ("cflags", "post_cflags", "cuda_cflags", "cuda_post_cflags")


def standards_in(build_ninja: Path) -> dict[str, set[str]]:
    """{ninja variable: {"c++20", ...}} for the compile flag lines of torch's build.ninja."""
    found: dict[str, set[str]] = {}
    for line in build_ninja.read_text().splitlines():
        name, sep, value = line.partition(" = ")
        if sep and name.strip() in FLAG_LINES:
            found[name.strip()] = set(re.findall(r"-std=(\S+)", value))
    return found


def check_cxx_standard(src: Path, recipe: Recipe, target: Target) -> str:
    """The standard the compile used (every build.ninja under src/build); raises BuildError on a mismatch."""
    files = sorted(src.glob("build/*/build.ninja"))
    if not files:
        raise BuildError(f"{recipe.name}: no build/*/build.ninja under {src} after the compile, so the C++ standard "
                         "cannot be checked; the recipe must build through torch.utils.cpp_extension with ninja.")
    want = target.torch.cxx_standard
    for path in files:
        for name, seen in standards_in(path).items():
            if seen and seen != {want}:
                raise BuildError(
                    f"{recipe.name} compiled with -std={','.join(sorted(seen))} ({name} in {path}), but torch "
                    f"{target.torch.version} needs {want} ([torch.{target.torch.name}].cxx_standard). The recipe "
                    f"passes its own -std; add a [[recipes.{recipe.key}.replace]] entry that drops it.")
    return want
