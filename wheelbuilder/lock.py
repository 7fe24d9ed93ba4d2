"""Regenerate the hash-pinned requirement files under locks/ from targets.toml and locks/*.in.

One lock folder per torch build (`[torch.X].lock`):
  locks/<lock>/builder.txt  torch + the toolkit's CUDA wheels + locks/builder.in   (builder stage)
  locks/<lock>/runtime.txt  torch + locks/runtime.in                              (runtime image, tests)
  locks/<lock>/common.txt   what the two share byte for byte (torch and its CUDA libraries): the
                            Dockerfile's python-torch stage installs it in one layer, so the builder and
                            the runtime image store those gigabytes once
and locks/dev.txt (locks/dev.in, constrained by the cu130 runtime lock) for the host's test tools.
Resolution uses `uv pip compile --generate-hashes` for the target's Python on manylinux x86_64, so the
files are the same whichever machine runs `make lock`, as long as it reaches the torch index.

`make lock` regenerates every lock whose torch comes from PyPI; a torch from another index (the PyTorch
cu128 index) is locked only when its target is named (`make lock TARGET=cu128-sm120-torch2.11`), so a
machine that reaches PyPI alone can always refresh the others.

locks/images.toml (the digests of the registry images a builder copies nvcc from) belongs to the image
side: images/pin_file.py reads and writes it, images/pins.py talks to the registry.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from packaging.utils import canonicalize_name

from common.cmd import echo, run
from .constraints import refuse_hidden_torch
from .errors import ConfigurationError, FatalError, ToolchainError
from .targets import PYPI_INDEX, REPO_ROOT, Catalog, Target

LOCKS = REPO_ROOT / "locks"
PLATFORM = "x86_64-manylinux_2_28"
LOCK_FILES = ("common.txt", "builder.txt", "runtime.txt")


def _compile(req: Path, python: str, index: str, out: Path, constraints: Path | None = None) -> None:
    """uv pip compile `req` (a file beside `out`, so the `# via` annotations name stable paths)."""
    # The venv's own uv (the dev lock pins it) first: `make lock` runs .venv/bin/python without the
    # venv on PATH.
    beside = Path(sys.executable).parent / "uv"
    uv = str(beside) if beside.is_file() else shutil.which("uv")
    if not uv:
        raise ToolchainError("`make lock` needs uv (pip install 'uv==0.9.30').")
    cmd = [uv, "pip", "compile", req.name, "--python-version", python, "--python-platform", PLATFORM,
           "--generate-hashes", "--no-header", "--emit-index-url", "-o", out.name]
    if index.rstrip("/") != PYPI_INDEX:
        # The torch index first (it holds the +cuXYZ builds), PyPI for everything else.
        cmd += ["--index-url", index, "--extra-index-url", "https://pypi.org/simple", "--index-strategy", "unsafe-best-match"]
    if constraints:
        cmd += ["-c", os.path.relpath(constraints, req.parent)]
    run(cmd, cwd=req.parent)


def requirement_entries(text: str) -> tuple[list[str], dict[str, str]]:
    """(option lines, {name: requirement line + its --hash lines}) of a `uv pip compile --generate-hashes`
    file; `# via` comments are dropped, so two files agree on an entry exactly when the pins do."""
    options: list[str] = []
    entries: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if line[0].isspace():
            if current is None:
                raise ToolchainError(f"unexpected continuation line in a lock file: {line!r}")
            entries[current].append(stripped.rstrip("\\ "))
        elif stripped.startswith("-"):
            options.append(stripped)
            current = None
        else:
            current = canonicalize_name(stripped.split("==")[0].split("[")[0])
            entries[current] = [stripped.rstrip("\\ ")]
    return options, {name: " \\\n    ".join(parts) for name, parts in entries.items()}


def resolved_version(text: str, package: str) -> str | None:
    """The version a lock file pins for `package` (None when it pins none)."""
    entry = requirement_entries(text)[1].get(canonicalize_name(package))
    return entry.split(" \\", 1)[0].partition("==")[2].strip() if entry else None


def common_requirements(lock: str, *files: str) -> str:
    """The requirements every one of `files` pins identically (same version, same hashes), as a
    requirements file for `pip install --require-hashes --no-deps`."""
    parsed = [requirement_entries(text) for text in files]
    options = parsed[0][0]
    def key(entry: str | None):
        # The same pin whatever the spelling of the name or the order of the hashes.
        if entry is None:
            return None
        first, *hashes = entry.split(" \\\n    ")
        name, _, rest = first.partition("==")
        return canonicalize_name(name), rest, sorted(hashes)

    shared = [name for name, entry in sorted(parsed[0][1].items())
              if all(key(p[1].get(name)) == key(entry) for p in parsed[1:])]
    header = (f"# Generated by `make lock` from locks/{lock}/builder.txt and runtime.txt: the pins both share,\n"
              "# installed with --no-deps in the Dockerfile's python-torch stage (one layer for both images).\n")
    return header + "\n".join(options) + "\n\n" + "\n".join(parsed[0][1][n] for n in shared) + "\n"


def lock_inputs(catalog: Catalog, lock: str) -> dict[str, str]:
    """{"runtime": text, "builder": text}: the .in files `make lock` writes into locks/<lock>/ from
    targets.toml, then resolves."""
    targets = [t for t in catalog.targets.values() if t.torch.lock == lock]
    if not targets:
        raise ConfigurationError(f"no target uses torch lock '{lock}'; lock folders in use: "
                                 f"{', '.join(sorted({t.torch.lock for t in catalog.targets.values()}))}.")
    torch = targets[0].torch
    toolkit_pkgs = sorted({p for t in targets for p in t.toolkit.packages})
    header = f"# Generated by `make lock` from targets.toml ([torch.{torch.name}]); do not edit.\n"
    return {"runtime": header + "\n".join([f"torch=={torch.version}", "-r ../runtime.in"]) + "\n",
            "builder": header + "\n".join([f"torch=={torch.version}", *toolkit_pkgs, "-r ../builder.in"]) + "\n"}


def lock_torch(catalog: Catalog, lock: str) -> list[Path]:
    targets = [t for t in catalog.targets.values() if t.torch.lock == lock]
    pythons = {t.python for t in targets}
    if len(pythons) != 1:
        raise ToolchainError(f"targets sharing torch lock '{lock}' use different Pythons {sorted(pythons)}; give each its own lock.")
    python, torch = pythons.pop(), targets[0].torch
    refuse_hidden_torch(torch.version, f"[torch.{torch.name}] in {catalog.path.name}")
    folder = LOCKS / lock
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        return _lock_folder(catalog, lock, folder, python, torch)
    except FatalError as e:
        if created:  # a first lock that failed leaves nothing half-made behind
            shutil.rmtree(folder, ignore_errors=True)
        if isinstance(e, ConfigurationError):  # the resolver answered, with another torch: not the index's fault
            raise
        raise type(e)(f"{e}\nlocking locks/{lock}/ needs {torch.index} (torch {torch.version}): run it where "
                      "that index is reachable.") from None


def _lock_folder(catalog: Catalog, lock: str, folder: Path, python: str, torch) -> list[Path]:
    written = []
    for name, text in lock_inputs(catalog, lock).items():
        # The input is generated from targets.toml; resolve into a temporary name, then rename, so a
        # failed resolution leaves the old lock intact.
        req = folder / f"{name}.in"
        req.write_text(text)
        tmp, current = folder / f".{name}.txt.tmp", folder / f"{name}.txt"
        if current.exists():  # uv keeps the pins of an existing output file unless the inputs rule them out
            shutil.copyfile(current, tmp)
        _compile(req, python, torch.index, tmp)
        got = resolved_version(tmp.read_text(), "torch")
        if got != torch.version:
            tmp.unlink(missing_ok=True)
            raise ConfigurationError(
                f"locks/{lock}/{name}.txt: the resolver chose torch {got}, but [torch.{torch.name}] in "
                f"{catalog.path.name} asks for {torch.version}. A constraint (UV_CONSTRAINT, a uv.toml) or an "
                "index that lacks the version changed the result; the old lock is kept.")
        echo(f"locks/{lock}/{name}.txt: resolved torch {got} from {torch.index} (requested {torch.version})")
        tmp.replace(current)
        written.append(current)
    tmp = folder / ".common.txt.tmp"
    tmp.write_text(common_requirements(lock, *(p.read_text() for p in written)))
    tmp.replace(folder / "common.txt")
    return written + [folder / "common.txt"]


def lock_all(catalog: Catalog, only: str | None = None, target: str | None = None) -> list[Path]:
    """Regenerate the locks: every PyPI torch lock and dev.txt; `only` one lock folder (or 'dev');
    `target` the lock of one target, whatever its index."""
    if target:
        locks = [catalog.target(target).torch.lock]
    else:
        locks = sorted({t.torch.lock for t in catalog.targets.values()
                        if t.torch.from_pypi and (not only or t.torch.lock == only)})
        for t in sorted(catalog.targets.values(), key=lambda t: t.name):
            if not t.torch.from_pypi and (not only or t.torch.lock == only):
                if only:  # named by folder: lock it as if its target had been named
                    locks.append(t.torch.lock)
                else:
                    print(f"skipped locks/{t.torch.lock}/ (torch {t.torch.version} from {t.torch.index}): "
                          f"`make lock TARGET={t.name}` where that index is reachable")
        locks = sorted(set(locks))
    for lock in locks:  # every torch checked before the first file is written
        torch = next(t.torch for t in catalog.targets.values() if t.torch.lock == lock)
        refuse_hidden_torch(torch.version, f"[torch.{torch.name}] in {catalog.path.name}")
    written = []
    for lock in locks:
        written += lock_torch(catalog, lock)
    if not target and (not only or only == "dev"):
        tmp = LOCKS / ".dev.txt.tmp"
        shutil.copyfile(LOCKS / "dev.txt", tmp)
        _compile(LOCKS / "dev.in", "3.11", PYPI_INDEX, tmp, constraints=LOCKS / "cu130" / "runtime.txt")
        tmp.replace(LOCKS / "dev.txt")
        written.append(LOCKS / "dev.txt")
    return written


def require_locks(target: Target) -> Path:
    """locks/<lock>/ of `target` with its three files, or an error naming the command that makes them."""
    folder = LOCKS / target.torch.lock
    for name in LOCK_FILES:
        if not (folder / name).is_file():
            raise ConfigurationError(
                f"locks/{target.torch.lock}/{name} is missing: target {target.name} installs torch "
                f"{target.torch.version} from {target.torch.index} with hashes from it. Generate it with "
                f"`make lock TARGET={target.name}` on a machine that reaches that index, and commit it."
            )
    return folder
