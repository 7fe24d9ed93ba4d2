"""The ABI check: a wheel imported against its own torch, in a venv of its own.

A C++ extension only loads beside the torch minor it was compiled against (`undefined symbol:
_ZN3c10...` otherwise), and the builder's environment proves nothing about a user's. So each wheel goes
into a fresh venv that holds exactly its target's torch (locks/<lock>/common.txt, hash-checked, which
also satisfies the wheel's own requirements torch, packaging and ninja), is installed with --no-deps,
and its extension module is imported after torch. uv, when present (the dev lock pins it), installs as
hard links from its cache, so a venv per torch line costs seconds and almost no disk.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from common.cmd import run
from .errors import AuditError, ToolchainError
from .lock import require_locks
from .targets import Target

PROBE = """
import importlib, importlib.metadata as md, json, sys, torch
module = importlib.import_module(sys.argv[1])
print(json.dumps({"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                  "version": md.version(sys.argv[2]), "module": module.__file__}))
"""


def _installer(python: Path) -> list[str]:
    uv = Path(sys.executable).parent / "uv"
    uv = str(uv) if uv.is_file() else shutil.which("uv")
    if uv:
        return [uv, "pip", "install", "--quiet", "--python", str(python), "--link-mode", "hardlink"]
    return [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]


def make_torch_venv(target: Target, venv: Path) -> Path:
    """A fresh venv at `venv` with the target's torch from its lock; returns its python."""
    interpreter = shutil.which(f"python{target.python}")
    if interpreter is None:
        raise ToolchainError(f"the ABI check of {target.name} needs python{target.python} on PATH (the wheel is "
                             f"built for CPython {target.python}); install it (Debian: apt-get install "
                             f"python{target.python}-venv).")
    folder = require_locks(target)
    run([interpreter, "-m", "venv", "--clear", str(venv)])
    python = venv / "bin" / "python"
    run(_installer(python) + ["--require-hashes", "--no-deps", "-r", str(folder / "common.txt")])
    return python


def import_check(wheel: Path, target: Target, venv: Path) -> dict:
    """Install `wheel` into a fresh venv with its target's torch and import each recipe's module;
    returns {"torch", "torch_cuda", "version", "module"} as seen inside that venv."""
    recipe = next((r for r in target.recipes if wheel.name.startswith(r.dist_name + "-")), None)
    if recipe is None:
        raise AuditError(f"{wheel.name} is not a wheel of a recipe of {target.name}; give the target it was built for.")
    python = make_torch_venv(target, venv)
    run(_installer(python) + ["--no-deps", str(wheel)])
    out = subprocess.run([str(python), "-c", PROBE, recipe.import_check, recipe.name], capture_output=True,
                         text=True, cwd=venv)
    if out.returncode != 0:
        raise AuditError(
            f"{wheel.name} does not import beside torch {target.torch.version} in a venv of its own ({venv}):\n"
            f"{out.stderr.strip()[-2000:]}\nAn `undefined symbol` names a torch ABI mismatch: rebuild it against "
            f"locks/{target.torch.lock}/builder.txt (`make wheels TARGET={target.name}`).")
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    if seen["torch"].split("+")[0] != target.torch.public or not seen["module"].startswith(str(venv)):
        raise AuditError(f"{wheel.name}: the ABI check's venv holds torch {seen['torch']} and module "
                         f"{seen['module']}; expected torch {target.torch.version} and a module inside {venv}.")
    return seen
