"""`dflash doctor`: prove that the fast GatedDeltaNet kernels really load and really run (docs/architecture.md, "The doctor's checks").

    dflash doctor                       # aligned table; exit 1 when a required check fails
    dflash doctor --json                # the same as JSON (schema in dflash/doctor/verdict.py)
    dflash doctor --quick               # the cheap subset: versions, import, arch, C compiler
    dflash doctor --require-gpu         # no visible GPU is itself a failure
    dflash doctor --expect-arch 12.0    # without a GPU, the arch the extension must cover (or DFLASH_EXPECT_ARCHES)
    dflash doctor --save /tmp/dflash/doctor.json   # also keep the verdict for `dflash healthcheck`
    dflash doctor --multi-node          # also the network a run across nodes needs (network.py)
    python -m dflash.doctor ...         # the same, without the console script

Exit codes: 0 no required check failed; 1 a required check failed; 2 a bad option (an arch spelling,
a --save path that cannot be written), found before any check runs.

Checks, in order: gpu, versions, import, arch, dispatch, kernel-path, numerics, triton, shm, loopback.
Without a GPU, versions, import, arch and dispatch still run; kernel-path names the path each GatedDeltaNet
op takes on the CPU (the torch reference) and reports skip; numerics and the Triton JIT report skip with
the reason, and the C compiler Triton needs is still checked. shm and loopback (ipc.py: what --num-proc, DataLoader
workers, NCCL and torchrun need from the container) always run, --quick included. network (a routable
interface, a hostname that resolves to a usable address) runs when the run spans nodes: --multi-node, or
under a torchrun whose WORLD_SIZE exceeds its LOCAL_WORLD_SIZE.

Dispatch is checked even without a GPU because transformers (5.24, 5.25) picks the fast or the torch
function once, when the model module is imported, by importing the kernel package; the GPU plays no part in
that choice. A machine without causal-conv1d therefore FAILS dispatch: that is what it would run. Which
path an op then takes also depends on the device of its inputs and on a hub kernel `kernels.kernelize`
may have bound: the kernel-path check (kernel_path.py) asks a built layer.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dflash.doctor.verdict import DEFAULT_REPORT, FAIL, PASS, REPORT_ENV, SKIP, CheckResult, Report, render_table

EXPECT_ENV = "DFLASH_EXPECT_ARCHES"
QUICK_SKIPS = ("dispatch", "kernel-path", "numerics")  # the expensive ones: transformers + fla imports, kernel launches


@dataclass(frozen=True)
class Options:
    quick: bool = False
    require_gpu: bool = False
    expect_arches: tuple[int, ...] | None = None  # SM numbers; None: take them from the wheel's record
    multi_node: bool = False  # also check the network (always so under a torchrun spanning nodes)


def check_gpu(gpus: list[dict], require: bool) -> CheckResult:
    import torch

    if gpus:
        names = ", ".join(f"{g['index']}: {g['name']} (sm_{g['sm']})" for g in gpus)
        return CheckResult("gpu", PASS, f"{len(gpus)} visible: {names}", required=require, details={"gpus": gpus})
    why = ("torch is a CPU-only build" if torch.version.cuda is None
           else "torch.cuda.is_available() is False (no --gpus passed to the container, or no driver)")
    if require:
        return CheckResult("gpu", FAIL, f"no GPU visible: {why}; run with `docker run --gpus all` or pass the "
                           "GPUs through to the container", details={"gpus": []})
    return CheckResult("gpu", SKIP, f"no GPU visible: {why}; the GPU checks skip", required=False)


def check_numerics(gpus: list[dict]) -> CheckResult:
    if not gpus:
        return CheckResult("numerics", SKIP, "no GPU visible: the kernels run only on a GPU")
    from dflash.doctor.numerics import RTOL, run_numerics

    results, errors = run_numerics(gpus)
    bad = [f"GPU {r['device']} {r['name']} rel err {r['rel_err']:.2e} > {RTOL:.0e}" for r in results if not r["ok"]]
    details = {"rtol": RTOL, "results": results, "errors": errors}
    if bad or errors:
        return CheckResult("numerics", FAIL, "; ".join(bad + errors), details=details)
    worst = max(r["rel_err"] for r in results)
    names = sorted({r["name"].split(".")[0] for r in results})
    return CheckResult("numerics", PASS, f"{', '.join(names)} match float64 references on {len(gpus)} GPU(s), "
                       f"worst rel err {worst:.1e} <= {RTOL:.0e}", details=details)


def check_triton(gpus: list[dict], quick: bool) -> CheckResult:
    from dflash.doctor.checks import find_c_compiler

    cc = find_c_compiler()
    if cc is None:
        return CheckResult("triton", FAIL, "no C compiler ($CC, gcc or clang): Triton compiles its launcher with one "
                           "at first use, so every fla kernel would fail; install gcc (apt-get install gcc)")
    if not gpus or quick:
        why = "no GPU visible" if not gpus else "--quick"
        return CheckResult("triton", SKIP, f"JIT not run ({why}); C compiler for Triton's launcher: {cc}",
                           details={"cc": cc})
    from dflash.doctor.triton_jit import jit_smoke

    try:
        errs = {g["index"]: jit_smoke(f"cuda:{g['index']}") for g in gpus}
    except Exception as e:
        return CheckResult("triton", FAIL, f"Triton could not compile or run a kernel: {type(e).__name__}: {e}",
                           details={"cc": cc})
    bad = [f"GPU {i}: max abs err {e}" for i, e in errs.items() if not e == 0.0]
    if bad:
        return CheckResult("triton", FAIL, f"a JIT-compiled kernel computed wrong values: {'; '.join(bad)}",
                           details={"cc": cc, "errors": errs})
    return CheckResult("triton", PASS, f"compiled and ran a kernel on {len(gpus)} GPU(s) (cc: {cc})",
                       details={"cc": cc})


def run_checks(opts: Options, progress=None) -> Report:
    """Run every check in order; a check that crashes is reported as failed with its exception."""
    from dflash.doctor import checks as dc
    from dflash.doctor import ipc, kernel_path, network

    gpus = dc.visible_gpus()
    expected = list(opts.expect_arches) if opts.expect_arches is not None else None
    plan = [
        ("gpu", lambda: check_gpu(gpus, opts.require_gpu)),
        ("versions", dc.check_versions),
        ("import", dc.check_import),
        ("arch", lambda: dc.check_arch(gpus=gpus, expected=expected)),
        ("dispatch", dc.check_dispatch),
        ("kernel-path", lambda: kernel_path.check_kernel_path(gpus)),
        ("numerics", lambda: check_numerics(gpus)),
        ("triton", lambda: check_triton(gpus, opts.quick)),
        ("shm", ipc.check_shm),
        ("loopback", ipc.check_loopback),
    ]
    if opts.multi_node or network.spans_nodes():
        plan.append(("network", network.check_network))
    results = []
    for name, fn in plan:
        if progress:
            progress(f"doctor: {name} ...")
        t0 = time.perf_counter()
        if opts.quick and name in QUICK_SKIPS:
            result = CheckResult(name, SKIP, "skipped by --quick")
        else:
            try:
                result = fn()
            except Exception as e:  # a crash inside a check is a finding, not a reason to print no report
                result = CheckResult(name, FAIL, f"the check itself crashed: {type(e).__name__}: {e}")
        result.seconds = round(time.perf_counter() - t0, 3)
        results.append(result)
    return Report(checks=results, quick=opts.quick)


def run_and_save(path: str | os.PathLike | None = None, opts: Options | None = None) -> int:
    """The full doctor, once (the image's entrypoint calls this at container start); the verdict is
    written atomically to `path` (default $DFLASH_DOCTOR_REPORT or /tmp/dflash/doctor.json) for
    `dflash healthcheck`. Returns the exit code."""
    report = run_checks(opts or Options(expect_arches=expect_from_env()))
    report.save(path or os.environ.get(REPORT_ENV) or DEFAULT_REPORT)
    return report.exit_code


def probe_save_path(path: Path) -> None:
    """Raise OSError now when the verdict could not be written to `path` later: the directory must
    exist or be creatable, and take a new file (the atomic write puts its temporary file there)."""
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    existing = next(p for p in path.parents if p.exists())
    if not existing.is_dir():  # mkdir would say "File exists", which hides the problem
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(existing))
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".probe"):
        pass


def save_error(path: Path, exc: OSError) -> str:
    """What went wrong writing the verdict to `path`, and the fix."""
    why = f"{exc.strerror}: {exc.filename}" if exc.strerror and exc.filename else f"{type(exc).__name__}: {exc}"
    if isinstance(exc, IsADirectoryError) and exc.filename == str(path):
        fix = f"name a file, e.g. --save {path / 'doctor.json'}"
    else:
        fix = f"pass --save a file in a writable directory, or make {path.parent} a writable directory"
    return (f"--save {path}: cannot write the verdict there ({why}); {fix} "
            f"(the health check reads ${REPORT_ENV}, default {DEFAULT_REPORT}).")


def expect_from_env() -> tuple[int, ...] | None:
    text = os.environ.get(EXPECT_ENV, "").strip()
    return _parse_arch_list(text, f"${EXPECT_ENV}") if text else None


def _parse_arch_list(text: str, where: str) -> tuple[int, ...]:
    from dflash.doctor.checks import parse_sm

    try:
        sms = tuple(sorted({parse_sm(a) for a in text.replace(" ", ",").split(",") if a}))
    except ValueError as e:
        raise ValueError(f"{where}: {e} Example: {where.lstrip('-$')}=12.0 or 9.0,12.0.") from None
    if not sms:
        raise ValueError(f"{where}={text!r} names no arch. Example: {where.lstrip('-$')}=12.0 or 9.0,12.0.")
    try:
        from wheelbuilder.targets import ARCH_MIN_CUDA
    except ImportError:  # an install without the build tools: the spelling check above is all there is
        return sms
    known = {int(a.replace(".", "")) for a in ARCH_MIN_CUDA}
    unknown = [f"{sm // 10}.{sm % 10}" for sm in sms if sm not in known]
    if unknown:
        raise ValueError(f"{where}: {', '.join(unknown)} is not a GPU arch (known: {', '.join(ARCH_MIN_CUDA)}); "
                         f"a typo would make the check pass or fail for the wrong GPU. Example: "
                         f"{where.lstrip('-$')}=12.0.")
    return sms


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash doctor", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.add_argument("--quick", action="store_true",
                   help="the cheap subset: skip dispatch, kernel-path, numerics and the Triton JIT (the C compiler is "
                        "still checked)")
    p.add_argument("--require-gpu", action="store_true", help="fail when no GPU is visible")
    p.add_argument("--expect-arch", action="append", default=None, metavar="ARCH",
                   help=f"arch the extension must cover when no GPU is visible, e.g. 12.0 (repeat or comma-separate; "
                        f"default: ${EXPECT_ENV}, else the wheel's build record)")
    p.add_argument("--multi-node", action="store_true",
                   help="also check what a run across nodes needs: a routable interface and a hostname that resolves "
                        "to a usable address (on by itself under a torchrun that spans nodes)")
    p.add_argument("--save", metavar="PATH", default=None,
                   help=f"also write the JSON verdict to PATH atomically (the health check reads ${REPORT_ENV}, "
                        f"default {DEFAULT_REPORT})")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # bad arch spellings stop here, before any check runs
        expect = (_parse_arch_list(",".join(args.expect_arch), "--expect-arch") if args.expect_arch
                  else expect_from_env())
    except ValueError as e:
        parser.error(str(e))
    save = Path(args.save) if args.save else None
    if save is not None:  # an unwritable --save also stops here, not after a full run
        try:
            probe_save_path(save)
        except OSError as e:
            parser.error(save_error(save, e))
    opts = Options(quick=args.quick, require_gpu=args.require_gpu, expect_arches=expect, multi_node=args.multi_node)
    progress = (lambda msg: print(msg, file=sys.stderr, flush=True)) if sys.stderr.isatty() else None
    report = run_checks(opts, progress)
    print(report.to_json() if args.json else render_table(report))
    if save is not None:
        try:
            report.save(save)
        except OSError as e:  # the directory changed while the checks ran
            print(f"dflash doctor: error: {save_error(save, e)}", file=sys.stderr)
            return 2
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
