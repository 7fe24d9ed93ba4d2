"""Regenerate the hash-pinned requirement files under locks/ from targets.toml and locks/*.in.

One lock folder per torch build (`[torch.X].lock`):
  locks/<lock>/builder.txt  torch + the toolkit's CUDA wheels + locks/builder.in   (builder stage)
  locks/<lock>/runtime.txt  torch + locks/runtime.in                              (runtime image, tests)
and locks/dev.txt (locks/dev.in, constrained by the cu130 runtime lock) for the host's test tools.
Resolution uses `uv pip compile --generate-hashes` for the target's Python on manylinux x86_64, so the
files are the same whichever machine runs `make lock`, as long as it reaches the torch index.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from .cmd import run
from .errors import ToolchainError
from .targets import REPO_ROOT, Catalog

LOCKS = REPO_ROOT / "locks"
PLATFORM = "x86_64-manylinux_2_28"


def _compile(requirements: list[str], python: str, index: str, out: Path, constraints: Path | None = None) -> None:
    uv = shutil.which("uv")
    if not uv:
        raise ToolchainError("`make lock` needs uv (pip install 'uv==0.9.30').")
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "requirements.in"
        req.write_text("\n".join(requirements) + "\n")
        cmd = [uv, "pip", "compile", str(req), "--python-version", python, "--python-platform", PLATFORM,
               "--generate-hashes", "--no-header", "--emit-index-url", "-o", str(out)]
        if index != "https://pypi.org/simple":
            # The torch index first (it holds the +cuXYZ builds), PyPI for everything else.
            cmd += ["--index-url", index, "--extra-index-url", "https://pypi.org/simple", "--index-strategy", "unsafe-best-match"]
        if constraints:
            cmd += ["-c", str(constraints)]
        run(cmd, cwd=LOCKS)


def lock_torch(catalog: Catalog, lock: str) -> list[Path]:
    targets = [t for t in catalog.targets.values() if t.torch.lock == lock]
    pythons = {t.python for t in targets}
    if len(pythons) != 1:
        raise ToolchainError(f"targets sharing torch lock '{lock}' use different Pythons {sorted(pythons)}; give each its own lock.")
    python, torch = pythons.pop(), targets[0].torch
    folder = LOCKS / lock
    folder.mkdir(parents=True, exist_ok=True)
    toolkit_pkgs = sorted({p for t in targets for p in t.toolkit.packages})
    written = []
    for name, reqs in (("runtime.txt", [f"torch=={torch.version}", "-r runtime.in"]),
                       ("builder.txt", [f"torch=={torch.version}", *toolkit_pkgs, "-r builder.in"])):
        # Resolve into a temporary name, then rename: a failed resolution leaves the old lock intact.
        tmp = folder / f".{name}.tmp"
        _compile([r.replace("-r ", f"-r {LOCKS}/") for r in reqs], python, torch.index, tmp)
        tmp.replace(folder / name)
        written.append(folder / name)
    return written


def lock_all(catalog: Catalog, only: str | None = None) -> list[Path]:
    locks = sorted({t.torch.lock for t in catalog.targets.values()})
    written = []
    for lock in locks:
        if only and lock != only:
            continue
        written += lock_torch(catalog, lock)
    if not only or only == "dev":
        tmp = LOCKS / ".dev.txt.tmp"
        _compile([f"-r {LOCKS}/dev.in"], "3.11", "https://pypi.org/simple", tmp, constraints=LOCKS / "cu130" / "runtime.txt")
        tmp.replace(LOCKS / "dev.txt")
        written.append(LOCKS / "dev.txt")
    return written
