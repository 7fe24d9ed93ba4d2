"""`python -m wheelbuilder`: list targets, show a build plan, build natively, audit, regenerate locks.

    python -m wheelbuilder list
    python -m wheelbuilder build --target cu130-sm120 [--arch 12.0] [--python 3.12] [--out DIR] [--dry-run]
    python -m wheelbuilder audit --target cu130-sm120 dist/wheels/cu130-sm120/*.whl
    python -m wheelbuilder lock [--target cu128-sm120-torch2.11]
    python -m wheelbuilder prepare-toolkit      (inside the builder stage: pip CUDA layout -> CUDA_HOME,
                                                 header mtimes clamped to SOURCE_DATE_EPOCH)
    python -m wheelbuilder diff A.whl B.whl     (why two wheels or ELF files differ: sections, symbols)
    python -m wheelbuilder import-check --target T WHEEL  (the ABI check: a fresh venv with T's torch alone)
    python -m wheelbuilder index [--wheels dist/wheels] [--out dist/index]
                                                (a PEP 503 simple index of the verified wheels, per target)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import targets as tg
from . import variants
from common.cli import DefaultsOnceHelpFormatter, add_version
from common.cli import run_cli

from .errors import ConfigurationError, FatalError
from common.fsutil import DIST_WHEELS, REPO_ROOT


def _directory(option: str, absolute: bool = True):
    """The type of a directory option: an absolute path, fixed once here. pip compiles with its working
    directory in the unpacked source, where a relative --out or --build-dir names another place (the wheel
    lands in the source tree; pip reads the source path as a requirement). absolute=False (`index`, which
    runs no pip): the path as given, so messages name it as the user wrote it."""
    def directory(text: str) -> Path:
        if not text.strip():
            raise ConfigurationError(f"{option} is empty (an unset shell variable?); give a directory, or drop "
                                     f"{option} for its default")
        path = Path(text).expanduser()
        return path.absolute() if absolute else path
    return directory


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="wheelbuilder", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets-file", type=Path, default=tg.DEFAULT_TARGETS_FILE, help="targets file (default: %(default)s)")
    add_version(p)
    sub = p.add_subparsers(dest="command", required=True)

    sub.add_parser("list", help="list the targets with their pins").add_argument("--json", action="store_true", help="print JSON")

    b = sub.add_parser("build", help="build a target's wheels natively (needs nvcc and the target's torch here)",
                       formatter_class=DefaultsOnceHelpFormatter)
    b.add_argument("--target", default=None, help="target name from targets.toml (default: its default_target)")
    b.add_argument("--arch", default=None, help="override the target's arches, e.g. 9.0,12.0+PTX")
    b.add_argument("--python", default=None,
                   help="build for this CPython (e.g. 3.12) instead of the toolkit's; a native build runs under it")
    b.add_argument("--out", type=_directory("--out"), default=None,
                   help="output directory (default: dist/wheels/<target>)")
    b.add_argument("--build-dir", type=_directory("--build-dir"), default=Path("/tmp/wheelbuilder"),
                   help="fixed directory the sources are unpacked and compiled in (paths end up in the objects)")
    b.add_argument("--log-dir", type=_directory("--log-dir"), default=None,
                   help="where build logs go (default: the output directory)")
    b.add_argument("--dry-run", action="store_true", help="check the toolchain and print the plan, build nothing")

    a = sub.add_parser("audit", help="audit built wheels against a target")
    a.add_argument("--target", default=None, help="target name (default: the default target)")
    a.add_argument("--python", default=None, help="the CPython the wheels were built for (default: the toolkit's)")
    a.add_argument("wheels", nargs="+", type=Path, help="wheel files")
    a.add_argument("--json", action="store_true", help="print JSON")

    v = sub.add_parser("verify", help="check every wheel listed in a manifest.json exists with its sha256")
    v.add_argument("--dir", type=Path, required=True, help="folder holding manifest.json and the wheels")

    lk = sub.add_parser("lock", help="regenerate locks/ from targets.toml and locks/*.in (needs uv)")
    lk.add_argument("--only", default=None, help="one lock folder (e.g. cu130) or 'dev'")
    lk.add_argument("--target", default=None,
                    help="lock this target's torch, also from a non-PyPI index (default: every PyPI torch and dev)")

    sub.add_parser("prepare-toolkit", help="builder stage only: make NVIDIA's pip CUDA wheels usable as CUDA_HOME, "
                   "clamp CUDA's and torch's header mtimes to SOURCE_DATE_EPOCH, print CUDA_HOME")

    ic = sub.add_parser("import-check", help="install a wheel into a fresh venv holding only its target's torch "
                        "(hash-pinned lock) and import its module: the ABI check")
    ic.add_argument("--target", default=None, help="target the wheel was built for (default: the default target)")
    ic.add_argument("--venv", type=_directory("--venv"), default=Path("/tmp/wheelbuilder-abi"),
                    help="where the venv is made (emptied first; one folder per target below it)")
    ic.add_argument("wheel", type=Path, help="the wheel file")

    ix = sub.add_parser("index", help="write a PEP 503 simple index (one per target, and one of all) from the "
                        "verified wheels, for pip --index-url through any static file server",
                        formatter_class=DefaultsOnceHelpFormatter)
    ix.add_argument("--wheels", type=_directory("--wheels", absolute=False), default=DIST_WHEELS,
                    help="folder of <target>/ folders, each with wheels and manifest.json")
    ix.add_argument("--out", type=_directory("--out", absolute=False), default=DIST_WHEELS.parent / "index",
                    help="index folder (replaced as a whole)")

    d = sub.add_parser("diff", help="explain how two wheels or ELF files differ (exit 1 when they do, 6 when a "
                       "wheel is damaged)")
    d.add_argument("a", type=Path, help="first wheel or ELF file")
    d.add_argument("b", type=Path, help="second wheel or ELF file")
    return p


def _verify_manifest(args: argparse.Namespace) -> int:
    """`verify`: every wheel of the folder's manifest.json is there with its sha256."""
    from .manifest import read_manifest, verify_wheels

    problems = verify_wheels(args.dir)
    if problems:
        raise FatalError(f"{args.dir}: " + "; ".join(problems))
    for w in read_manifest(args.dir).wheels:
        print(f"ok  {w.sha256}  {w.filename}")
    return 0


def _write_index(args: argparse.Namespace) -> int:
    """`index`: the PEP 503 index of the verified wheels, and how to install from it per target."""
    from .index import write_index

    record = write_index(args.wheels, args.out)
    for target in sorted({w["target"] for w in record["wheels"]}):
        print(f"{target:<24} pip install causal-conv1d --index-url <server>/{target}/simple")
    print(f"wrote {args.out} ({len(record['wheels'])} wheels); serve it, e.g. "
          f"`python -m http.server -d {args.out} 8000`")
    return 0


def _list_targets(args: argparse.Namespace, catalog: tg.Catalog) -> int:
    """`list`: the targets with their pins, as a table (the default one starred) or as JSON."""
    rows = [{"target": t.name, "default": t.name == catalog.default_target, "cuda": str(t.toolkit.cuda),
             "toolkit": t.toolkit.kind, "torch": t.torch.version, "torch_index": t.torch.index,
             "cxx_standard": t.torch.cxx_standard, "lock": t.torch.lock, "python": t.python,
             "arches": [str(a) for a in t.arches], "recipes": [r.key for r in t.recipes],
             "description": t.description} for t in catalog.targets.values()]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            star = "*" if r["default"] else " "
            print(f"{star} {r['target']:<22} CUDA {r['cuda']:<7} torch {r['torch']:<13} py{r['python']:<5} "
                  f"arches {','.join(r['arches']):<10} {r['description']}")
        lines = sorted({tg.Version(t.torch.version).release[:2] for t in catalog.targets.values()})
        print(f"{len(lines)} torch lines: " + ", ".join(f"{a}.{b}" for a, b in lines))
    return 0


def _build_wheels(args: argparse.Namespace, catalog: tg.Catalog) -> int:
    """`build`: the target, with --arch and --python applied, built natively (or its plan, with --dry-run)."""
    from .build import build_target

    target = catalog.target(args.target)
    if args.arch is not None:  # `--arch ''` is a mistake, not "the target's arches"
        target = variants.with_arches(target, args.arch)
    if args.python:
        target = variants.with_python(target, args.python)
    out = args.out or DIST_WHEELS / target.name
    build_target(target, out, build_root=args.build_dir, log_dir=args.log_dir, dry_run=args.dry_run)
    return 0


def _audit_wheels(args: argparse.Namespace, catalog: tg.Catalog) -> int:
    """`audit`: each wheel against the recipe of the target it is named after."""
    from .audit import audit_wheel

    target = catalog.target(args.target)
    if args.python:
        target = variants.with_python(target, args.python)
    reports = []
    for wheel in args.wheels:
        recipe = next((r for r in target.recipes if wheel.name.startswith(r.dist_name + "-")), None)
        if recipe is None:
            raise FatalError(f"{wheel.name} is not a wheel of any recipe of {target.name} (its wheels are named "
                             f"{', '.join(r.dist_name + '-*.whl' for r in target.recipes)}); pass those, or "
                             "--target the wheel was built for.")
        reports.append(audit_wheel(wheel, target, recipe).to_dict())
    print(json.dumps(reports, indent=2) if args.json else "\n".join(f"ok  {w}" for w in args.wheels))
    return 0


def _write_locks(args: argparse.Namespace, catalog: tg.Catalog) -> int:
    """`lock`: regenerate the lock files, naming each one written."""
    from .lock import lock_all

    for path in lock_all(catalog, args.only, args.target):
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


def _check_import(args: argparse.Namespace, catalog: tg.Catalog) -> int:
    """`import-check`: the wheel imported in a fresh venv beside its target's torch alone."""
    from .abicheck import import_check

    target = catalog.target(args.target)
    if not args.wheel.is_file():
        raise FatalError(f"{args.wheel}: no such wheel file")
    seen = import_check(args.wheel.absolute(), target, args.venv / target.name)
    print(f"ok  {args.wheel.name} imports beside torch {seen['torch']} (CUDA {seen['torch_cuda']}) in "
          f"{args.venv / target.name}")
    return 0


def _diff_files(args: argparse.Namespace) -> int:
    """`diff`: how two wheels or ELF files differ; 1 when they do, 0 when they are identical."""
    from .elfdiff import explain

    for path in (args.a, args.b):
        if not path.is_file():
            raise FatalError(f"{path}: no such file")
    lines = explain(args.a, args.b)
    print("\n".join(lines) if lines else f"{args.a} and {args.b} are identical")
    return 1 if lines else 0


def _prepare_toolkit() -> int:
    """`prepare-toolkit`: pip's CUDA layout made a CUDA_HOME, header mtimes clamped, CUDA_HOME printed."""
    from common.fsutil import source_date_epoch
    from .toolkit import clamp_mtimes, find_cuda_home, header_roots, pip_cuda_home, prepare_pip_cuda_home

    home = pip_cuda_home()
    if home:
        for made in prepare_pip_cuda_home(home):
            print(f"linked {made}", file=sys.stderr)
    cuda_home = find_cuda_home()
    epoch = source_date_epoch()
    roots = header_roots(cuda_home)
    changed = clamp_mtimes(roots, epoch)
    print(f"set the mtime of {changed} headers under {', '.join(map(str, roots))} to {epoch}", file=sys.stderr)
    print(cuda_home)
    return 0


def main_inner(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "verify":  # needs only the folder, not targets.toml
        return _verify_manifest(args)
    if args.command == "index":  # needs only the wheels' manifests
        return _write_index(args)
    catalog = tg.load(args.targets_file)
    if args.command == "list":
        return _list_targets(args, catalog)
    if args.command == "build":
        return _build_wheels(args, catalog)
    if args.command == "audit":
        return _audit_wheels(args, catalog)
    if args.command == "lock":
        return _write_locks(args, catalog)
    if args.command == "import-check":
        return _check_import(args, catalog)
    if args.command == "diff":
        return _diff_files(args)
    if args.command == "prepare-toolkit":
        return _prepare_toolkit()
    raise AssertionError(args.command)


def main(argv: list[str] | None = None) -> int:
    return run_cli("wheelbuilder", lambda: main_inner(argv), "interrupted; nothing was written to the output directory.")


if __name__ == "__main__":
    sys.exit(main())
