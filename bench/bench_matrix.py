"""The wheel matrix, built natively: every torch line's wheel, its build time, sha256 and ABI check.

    python bench/bench_matrix.py                                   (make bench-matrix: every PyPI target)
    python bench/bench_matrix.py --targets cu130-sm120-torch2.14,cu132-sm120-torch2.15 \
        --dist dist/wheels --results bench/results/cpu-2core/wheels-matrix.json

For each target, in turn (one compile at a time: each takes the machine's cores):
  1. a builder venv from locks/<lock>/builder.txt (uv, hard links from its cache; one per lock);
  2. `python -m wheelbuilder build` in it, cold (ccache off), in one fixed build directory, so a repeat
     on the same machine gives the same sha256 (the reproducibility check across lines);
  3. `python -m wheelbuilder import-check`: the wheel in a fresh venv holding only its torch, imported.
Targets whose nvcc comes from a registry image (kind "image") are listed as skipped with that reason.
The JSON record holds the machine, the toolchain and, per target, seconds, size and sha256.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.fsutil import sha256_file  # noqa: E402
from wheelbuilder import targets as tg  # noqa: E402
from wheelbuilder.manifest import read_manifest  # noqa: E402

BUILD_DIR = Path("/tmp/wheelbuilder-matrix")  # fixed: paths reach the objects


def sh(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> float:
    """Run `cmd` from the repository, output to `log`; returns its wall seconds (raises on failure)."""
    started = time.monotonic()
    with open(log, "ab") as f:
        f.write(f"+ {' '.join(cmd)}\n".encode())
        f.flush()
        done = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}; log: {log}")
    return round(time.monotonic() - started, 1)


def builder_venv(target: tg.Target, work: Path, log: Path) -> tuple[Path, float]:
    venv = work / "venvs" / target.torch.lock
    python = venv / "bin" / "python"
    if python.exists():
        return python, 0.0
    uv = Path(sys.executable).parent / "uv"
    seconds = sh([f"python{target.python}", "-m", "venv", str(venv)], log)
    seconds += sh([str(uv), "pip", "install", "--quiet", "--python", str(python), "--link-mode", "hardlink",
                   "--require-hashes", "-r", str(REPO / "locks" / target.torch.lock / "builder.txt")], log)
    return python, round(seconds, 1)


def bench_target(target: tg.Target, work: Path, dist: Path) -> dict:
    log = work / f"{target.name}.log"
    python, venv_s = builder_venv(target, work, log)
    out = dist / target.name
    env = dict(os.environ, WHEELBUILDER_NO_CCACHE="1", PYTHONPATH=str(REPO))
    build_s = sh([str(python), "-m", "wheelbuilder", "build", "--target", target.name, "--out", str(out),
                  "--build-dir", str(BUILD_DIR), "--log-dir", str(work / "logs" / target.name)], log, env)
    entry = next(w for w in read_manifest(out).wheels if w.target == target.name)
    wheel = out / entry.filename
    check_s = sh([sys.executable, "-m", "wheelbuilder", "import-check", "--target", target.name,
                  "--venv", str(work / "abi"), str(wheel)], log)
    shutil.rmtree(work / "abi" / target.name, ignore_errors=True)
    return {"target": target.name, "torch": target.torch.version, "cuda": str(target.torch.cuda),
            "cxx_standard": target.torch.cxx_standard, "nvcc": entry.toolchain.nvcc, "arches": entry.arches,
            "wheel": entry.filename, "size": wheel.stat().st_size, "sha256": sha256_file(wheel),
            "builder_venv_seconds": venv_s, "build_seconds": build_s, "compile_seconds": entry.build_seconds,
            "import_check_seconds": check_s, "import_check": "ok"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default="", help="comma-separated targets (default: every target whose toolkit "
                   "comes from PyPI)")
    p.add_argument("--dist", type=Path, default=None, help="where the wheels go, <dist>/<target>/ (default: a "
                   "temporary folder, removed afterwards)")
    p.add_argument("--results", type=Path, default=None, help="write the JSON record here as well")
    args = p.parse_args()
    catalog = tg.load()
    names = [n.strip() for n in args.targets.split(",") if n.strip()] or list(catalog.targets)
    work = Path(tempfile.mkdtemp(prefix="bench-matrix-"))
    dist = args.dist.absolute() if args.dist else work / "wheels"
    rows, skipped = [], {}
    started = time.monotonic()
    ok = False
    try:
        for name in names:
            target = catalog.target(name)
            if target.toolkit.kind != "pypi":
                skipped[name] = f"nvcc {target.toolkit.cuda} comes from the registry image {target.toolkit.image}"
                continue
            row = bench_target(target, work, dist)
            print(f"{row['target']:<24} build {row['build_seconds']:>6.1f} s  import-check "
                  f"{row['import_check_seconds']:>5.1f} s  {row['size'] / 1e6:5.1f} MB  {row['sha256']}", flush=True)
            rows.append(row)
        ok = True
    finally:
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:  # the build logs say why
            print(f"kept {work} (logs of the failed step)", file=sys.stderr)
    record = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
              "source_date_epoch": int(os.environ.get("SOURCE_DATE_EPOCH", 0)) or None,
              "targets": rows, "skipped": skipped,
              "total_seconds": round(time.monotonic() - started, 1)}
    text = json.dumps(record, indent=2) + "\n"
    print(text)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
