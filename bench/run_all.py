"""Every benchmark this machine can run, one after another (`make bench`); the others named with what they need.

    python bench/run_all.py                 run them (what `make bench` does)
    python bench/run_all.py --dry-run       only say which would run and which are skipped, and why

Each benchmark is its `make bench-*` target, in the Makefile's order: the Makefile holds the commands and
their defaults (TARGET, DRAFTER, PRESET given to `make bench` reach every target). Before each one, what
it needs is checked here:

    gpu        a CUDA GPU torch can see: bench-drafter, bench-fit, bench-plan and bench-layouts (27B shape), bench-flex, and
               bench-spec-step at PRESET=27b (PRESET=tiny runs on a CPU)
    nvcc       a CUDA toolkit on this machine (bench-build compiles natively)
    docker     a Docker engine that answers, or root (the targets' `engine` prerequisite starts one)
    sshd       OpenSSH's sshd and ssh-keygen, and root (a loopback server that logs in as root)
    registry   Debian's docker-registry and dockerd (a second engine), root
    drafter    a trained drafter at DRAFTER (bench-eval; `dflash-train` writes one)

A benchmark that cannot run here is reported as skipped with the reason; when one runs and fails, the
others still run. The summary at the end lists every benchmark's outcome; the exit status is 1 when any
benchmark failed (skips are not failures), 2 when the Makefile has a bench-* target this table lacks.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# what each `make bench-*` target needs beyond the venv (bench-spec-step: "gpu" only at PRESET=27b)
NEEDS = {
    "bench-build": ("nvcc",),
    "bench-matrix": ("nvcc",),
    "bench-train": (),
    "bench-length-mix": (),
    "bench-packed-target": ("gpu",),
    "bench-multi": (),
    "bench-drafter": ("gpu",),
    "bench-flex": ("gpu",),
    "bench-fit": ("gpu",),
    "bench-plan": ("gpu",),
    "bench-layouts": ("gpu",),
    "bench-scaling": (),
    "bench-kernels": (),
    "bench-loss": (),
    "bench-data": (),
    "bench-eval": ("drafter",),
    "bench-spec-step": ("gpu-at-27b",),
    "bench-image": ("docker",),
    "bench-push": ("docker", "sshd"),
    "bench-publish": ("docker", "sshd", "registry"),
}


def makefile_targets(makefile: Path = REPO / "Makefile") -> list[str]:
    """The bench-* targets the Makefile defines, in its order."""
    return re.findall(r"^(bench-[a-z-]+):", makefile.read_text(), re.M)


@functools.cache
def _gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def missing(need: str, args) -> str | None:
    """None when this machine has what `need` names, else what is missing."""
    root = os.geteuid() == 0
    if need == "gpu" or (need == "gpu-at-27b" and args.preset == "27b"):
        return None if _gpu() else "needs a CUDA GPU (torch sees none)" + (
            "; PRESET=tiny runs on a CPU" if need == "gpu-at-27b" else "")
    if need == "nvcc":
        from wheelbuilder.errors import ToolchainError
        from wheelbuilder.toolkit import find_cuda_home

        try:
            find_cuda_home()
            return None
        except ToolchainError:
            return "needs a CUDA toolkit (nvcc) on this machine"
    if need == "docker":
        from images.engine import engine_running

        if engine_running() or root:
            return None
        return "needs a Docker engine (none answers; `make engine` as root starts one)"
    if need == "sshd":
        if not (Path("/usr/sbin/sshd").exists() and shutil.which("ssh-keygen")):
            return "needs OpenSSH's sshd and ssh-keygen (apt install openssh-server)"
        return None if root else "needs root (the loopback sshd logs in as root)"
    if need == "registry":
        if not Path("/usr/bin/docker-registry").exists():
            return "needs Debian's docker-registry (apt install docker-registry)"
        return None if shutil.which("dockerd") and root else "needs dockerd and root (a second Docker engine)"
    if need == "drafter":
        return None if (REPO / args.drafter).is_dir() else (
            f"needs a trained drafter at DRAFTER={args.drafter} (train one with dflash-train, or give DRAFTER=dir)")
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="only say what would run and what is skipped")
    p.add_argument("--preset", default=os.environ.get("PRESET", "27b"), help="bench-spec-step's PRESET")
    p.add_argument("--drafter", default=os.environ.get("DRAFTER", "runs/dflash/drafter"), help="bench-eval's DRAFTER")
    args = p.parse_args(argv)
    targets = makefile_targets()
    unknown = [t for t in targets if t not in NEEDS]
    if unknown:
        print(f"bench/run_all.py does not know what {', '.join(unknown)} need: add them to NEEDS", file=sys.stderr)
        return 2
    outcomes: list[tuple[str, str]] = []
    for target in targets:
        why = next((m for m in (missing(n, args) for n in NEEDS[target]) if m), None)
        if why:
            print(f"== make {target}: skipped, {why}", flush=True)
            outcomes.append((target, f"skipped: {why}"))
            continue
        if args.dry_run:
            print(f"== make {target}: would run", flush=True)
            outcomes.append((target, "would run"))
            continue
        print(f"== make {target}", flush=True)
        rc = subprocess.run([os.environ.get("MAKE", "make"), "--no-print-directory", target], cwd=REPO).returncode
        outcomes.append((target, "ran" if rc == 0 else f"FAILED (exit {rc})"))
    print("\nbenchmarks:")
    for target, outcome in outcomes:
        print(f"  {target:<16} {outcome}")
    return 1 if any(o.startswith("FAILED") for _, o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
