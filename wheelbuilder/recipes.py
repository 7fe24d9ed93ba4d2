"""Fetch a recipe's pinned sdist, unpack it into a fixed build directory, and apply its patches.

Everything here is driven by the recipe's data in targets.toml: a second extension (flash-attn,
mamba-ssm) is a new [recipes.*] table, not new code.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from common.cmd import echo
from .errors import SourceError
from common.fsutil import sha256_file
from .targets import Arch, Recipe, Target

SDIST_CACHE = Path(os.environ.get("WHEELBUILDER_CACHE", Path.home() / ".cache" / "wheelbuilder")) / "sdist"
PATCH_MARKER = "# wheelbuilder: compile exactly the target's arches"


def _download(url: str, dest: Path) -> None:
    """Download with a progress bar to a temporary name beside `dest`, then rename."""
    from tqdm import tqdm

    tmp = dest.with_name(dest.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=60) as resp, open(tmp, "wb") as out:
            total = int(resp.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"download {dest.name}", leave=False) as bar:
                for chunk in iter(lambda: resp.read(1 << 16), b""):
                    out.write(chunk)
                    bar.update(len(chunk))
        tmp.replace(dest)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise SourceError(
            f"could not download {url}: {e}. If this machine is offline, place the file at {dest} "
            "(its sha256 is checked) or set WHEELBUILDER_CACHE to a directory holding sdist/<sha256>/<file>."
        ) from None


def fetch_sdist(recipe: Recipe, cache: Path = SDIST_CACHE) -> Path:
    """The recipe's sdist from the cache (keyed by sha256) or PyPI; its sha256 is always verified."""
    dest = cache / recipe.sha256 / recipe.sdist
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        echo(f"fetching {recipe.sdist} from {recipe.url}")
        _download(recipe.url, dest)
    got = sha256_file(dest)
    if got != recipe.sha256:
        bad = dest.with_name(dest.name + ".bad")
        dest.replace(bad)
        raise SourceError(
            f"{recipe.sdist}: sha256 {got} does not match the pin {recipe.sha256} in {recipe.source} "
            f"([recipes.{recipe.key}]). The file was moved aside to {bad}. If upstream really re-released it, "
            "check the new file and update the pin; otherwise the download was corrupted or tampered with."
        )
    return dest


def unpack(sdist: Path, build_dir: Path) -> Path:
    """Unpack into `build_dir` (emptied first) and return the source tree.

    The build directory is fixed per recipe (not a random temp dir): absolute source paths end up in
    the compiled objects (-lineinfo, __FILE__), so a fixed path is what makes two builds byte-identical.
    """
    if build_dir.exists():
        shutil.rmtree(build_dir)
    build_dir.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        _check_members(tar, build_dir, sdist)
        tar.extractall(build_dir)
    roots = [p for p in build_dir.iterdir() if p.is_dir()]
    if len(roots) != 1:
        raise SourceError(f"{sdist.name}: expected one top-level directory, found {[p.name for p in roots]}.")
    return roots[0]


def _check_members(tar: tarfile.TarFile, dest: Path, sdist: Path) -> None:
    """Refuse absolute paths, `..` escapes, links and device files (the `data` filter of Python >=
    3.11.4, which Debian 12's 3.11.2 lacks)."""
    root = dest.resolve()
    for m in tar.getmembers():
        target = (root / m.name).resolve()
        if not (m.isfile() or m.isdir()) or (target != root and root not in target.parents):
            raise SourceError(f"{sdist.name}: member {m.name!r} is not a plain file or directory inside the "
                              "archive's folder; refusing to unpack it.")


def _gencode_lines(arches: tuple[Arch, ...], variable: str, indent: str) -> str:
    flags: list[str] = []
    for arch in arches:
        flags += arch.gencode_flags()
    return (
        f"{indent}{PATCH_MARKER} (upstream hard-codes -gencode and ignores\n"
        f"{indent}# TORCH_CUDA_ARCH_LIST, see causal-conv1d issue #39): drop its arch flags, add ours.\n"
        f"{indent}{variable} = [f for i, f in enumerate({variable}) if f != '-gencode' and not "
        f"(i > 0 and {variable}[i - 1] == '-gencode')] + {flags!r}\n"
    )


def apply_patches(src: Path, recipe: Recipe, arches: tuple[Arch, ...]) -> list[str]:
    """Apply the recipe's arch patch and literal replacements; return a description of each edit.

    A patch that no longer applies (anchor or text not found the expected number of times) stops the
    build with SourceError instead of silently compiling upstream's arch list."""
    done: list[str] = []
    for rep in recipe.replace:
        path = src / rep.file
        text = path.read_text()
        n = text.count(rep.old)
        if n != rep.count:
            raise SourceError(
                f"{recipe.name} {recipe.version}: the replacement in {rep.file} expected {rep.count} "
                f"occurrence(s) of {rep.old!r}, found {n}. Update [[recipes.{recipe.key}.replace]] in {recipe.source}."
            )
        path.write_text(text.replace(rep.old, rep.new))
        done.append(f"{rep.file}: replaced {rep.old!r}")
    if recipe.arch_patch:
        p = recipe.arch_patch
        path = src / p.file
        lines = path.read_text().splitlines(keepends=True)
        hits = [i for i, line in enumerate(lines) if line.startswith(p.anchor)]
        if len(hits) != 1:
            raise SourceError(
                f"{recipe.name} {recipe.version}: the arch patch anchor {p.anchor!r} occurs {len(hits)} times "
                f"in {p.file} (expected once). Update [recipes.{recipe.key}.arch_patch] in {recipe.source}."
            )
        indent = p.anchor[: len(p.anchor) - len(p.anchor.lstrip())]
        lines.insert(hits[0], _gencode_lines(arches, p.variable, indent))
        path.write_text("".join(lines))
        done.append(f"{p.file}: {p.variable} -> {', '.join(str(a) for a in arches)}")
    return done


def recipe_env(recipe: Recipe, target: Target) -> dict[str, str]:
    """The recipe's build environment with placeholders filled in."""
    values = {"local_version": target.local_version()}
    return {k: v.format(**values) for k, v in recipe.env}


def stage_dir(parent: Path, prefix: str) -> Path:
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
