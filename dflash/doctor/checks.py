"""The doctor's checks that run without a GPU: 1-4 and the C-compiler half of 6 of "The doctor's
checks" in docs/architecture.md.

Each `check_*` function returns one CheckResult and never raises for a problem it was written to find;
the reason names what is wrong, the values seen, and the fix.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import json
import os
import re
import shutil
from typing import TYPE_CHECKING

from packaging.version import InvalidVersion, Version

from dflash.doctor.verdict import FAIL, PASS, SKIP, CheckResult

if TYPE_CHECKING:  # dflash.model.target imports torch: the checks import it only when they run
    from dflash.model.kernels import KernelFunction

WHEEL_FIX = "rebuild the wheel for the installed torch with `make wheels` and install it from dist/wheels/"
EXTENSION = "causal_conv1d_cuda"
CONV_DIST = "causal-conv1d"
# The model modules whose GatedDeltaNet layers must run the fast kernels.
QWEN35_MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5",)
# Where each kernel package comes from, for the fix in a failure message.
PACKAGE_FIX = {
    "causal_conv1d": "install the causal-conv1d wheel built by `make wheels` (dist/wheels/)",
    "fla": "install flash-linear-attention and fla-core from the locks (locks/*/runtime.txt)",
}


# ----------------------------------------------------------------------------------------------------
# Arches: "12.0", "sm_120", "sm120", "120" and "12.0+PTX" all mean SM 120.
# ----------------------------------------------------------------------------------------------------
def parse_sm(text: str | int) -> int:
    """An arch in any spelling the project uses -> its SM number (12.0 -> 120)."""
    s = str(text).strip().lower().removesuffix("+ptx")
    m = re.fullmatch(r"(\d+)\.(\d)", s) or re.fullmatch(r"(?:sm_?|compute_)?(\d+)(\d)", s)
    if not m or int(m.group(1)) < 3:  # no CUDA GPU is older than 3.0: '12' is a typo, not SM 1.2
        raise ValueError(f"arch '{text}' is not of the form MAJOR.MINOR (12.0) or sm_NNN (sm_120).")
    return int(m.group(1)) * 10 + int(m.group(2))


def sm_name(sm: int) -> str:
    return f"sm_{sm} ({sm // 10}.{sm % 10})"


def parse_label(label: str) -> dict:
    """A wheelbuilder local version label -> its parts: 'cu130torch2.11sm120' ->
    {"cuda": "13.0", "torch": "2.11", "arches": [120]}; {} when the label is not one of ours."""
    m = re.fullmatch(r"cu(\d+)(\d)torch(\d+\.\d+)((?:sm\d+(?:ptx)?)+)", label or "")
    if not m:
        return {}
    sms = [int(s) for s in re.findall(r"sm(\d+)", m.group(4))]
    return {"cuda": f"{m.group(1)}.{m.group(2)}", "torch": m.group(3), "arches": sms}


# ----------------------------------------------------------------------------------------------------
# 1. versions
# ----------------------------------------------------------------------------------------------------
def dist_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def build_record(dist_name: str = CONV_DIST) -> dict:
    """What the installed causal-conv1d says about its own build: its version, the local label's parts,
    and the `wheelbuilder.json` record the builder writes into the wheel's dist-info."""
    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        return {}
    version = dist.version
    out = {"version": version, "label": parse_label(Version(version).local or "") if _is_version(version) else {}}
    text = dist.read_text("wheelbuilder.json")
    if text is not None:
        try:
            out["record"] = json.loads(text)
        except json.JSONDecodeError as e:
            out["record_error"] = f"wheelbuilder.json in {dist_name}'s dist-info is not JSON ({e})"
    return out


def _is_version(text: str) -> bool:
    try:
        Version(text)
        return True
    except InvalidVersion:
        return False


def torch_matches(built: str, installed: str) -> bool:
    """Does a recorded build torch equal the installed one? Releases must be equal; a CUDA local label
    (+cu128) must be equal when both carry one (PyPI's 2.11.0 reports itself as 2.11.0+cu130). A bare
    minor ('2.11', from a wheel label) matches any release of that minor: that is the ABI unit."""
    b, i = Version(built), Version(installed)
    if len(b.release) == 2:
        return b.release == i.release[:2]
    if b.release[:3] != i.release[:3]:
        return False
    return not (b.local and i.local) or b.local == i.local


def check_versions() -> CheckResult:
    import torch

    found = {
        "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
        "transformers": dist_version("transformers"), "kernels": dist_version("kernels"),
        "fla-core": dist_version("fla-core"),
        "flash-linear-attention": dist_version("flash-linear-attention"), "triton": dist_version("triton"),
        "causal-conv1d": dist_version(CONV_DIST),
    }
    summary = (f"torch {found['torch']} (CUDA {found['cuda_runtime'] or 'none: CPU-only build'}), "
               f"transformers {found['transformers']} (kernels {found['kernels']}), fla {found['fla-core']}, "
               f"triton {found['triton']}, "
               f"causal-conv1d {found['causal-conv1d']}")
    missing = [k for k in ("transformers", "fla-core", "flash-linear-attention", "triton", "causal-conv1d")
               if found[k] is None]
    problems = []
    if missing:
        problems.append(f"not installed: {', '.join(missing)}")
    if found["cuda_runtime"] is None:
        problems.append("torch is a CPU-only build (torch.version.cuda is None); install the locked CUDA torch")
    rec = build_record()
    details = {"versions": found, "causal_conv1d_build": rec}
    if rec:
        problems += _build_problems(rec, found["torch"], found["cuda_runtime"])
    if problems:
        return CheckResult("versions", FAIL, "; ".join(problems) + f". Seen: {summary}", details=details)
    return CheckResult("versions", PASS, summary + f", built for torch {_built_torch(rec)}", details=details)


def _built_torch(rec: dict) -> str | None:
    return (rec.get("record") or {}).get("torch") or rec.get("label", {}).get("torch")


def _build_problems(rec: dict, torch_version: str, cuda: str | None) -> list[str]:
    """Compare causal-conv1d's recorded build (torch, CUDA) with what is installed."""
    if "record_error" in rec:
        return [rec["record_error"] + f"; {WHEEL_FIX}"]
    built = _built_torch(rec)
    if built is None:
        return [f"causal-conv1d {rec['version']} carries no build record (no wheelbuilder.json in its dist-info, "
                f"no wheelbuilder label), so nothing proves it was built against torch {torch_version}; {WHEEL_FIX}"]
    out = []
    if not torch_matches(built, torch_version):
        out.append(f"causal-conv1d {rec['version']} was built for torch {built} but torch {torch_version} is "
                   f"installed (a C++ extension only loads into the torch it was built against); {WHEEL_FIX}")
    built_cuda = (rec.get("record") or {}).get("cuda") or rec.get("label", {}).get("cuda")
    if built_cuda and cuda and Version(built_cuda).release[:2] != Version(cuda).release[:2]:
        out.append(f"causal-conv1d was built with CUDA {built_cuda} but torch runs CUDA {cuda}; {WHEEL_FIX}")
    return out


# ----------------------------------------------------------------------------------------------------
# 2. import
# ----------------------------------------------------------------------------------------------------
def explain_import_error(module: str, exc: BaseException) -> str:
    """Turn an import failure into what it means here, with the fix."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ModuleNotFoundError) and exc.name and module.startswith(exc.name):
        pkg = PACKAGE_FIX.get(module.split(".")[0], PACKAGE_FIX["causal_conv1d"])
        return f"{module} is not installed; {pkg}"
    if "undefined symbol" in str(exc):
        import torch

        return (f"{module} does not match torch {torch.__version__}'s ABI ({text}): it was built against another "
                f"torch; {WHEEL_FIX}")
    if "cannot open shared object file" in str(exc):
        return f"{module} needs a shared library that is missing ({text}): CUDA runtime mismatch?; {WHEEL_FIX}"
    return f"{module} failed to import ({text})"


def check_import() -> CheckResult:
    import torch  # noqa: F401  the extension links libc10/libtorch, which torch loads first

    modules = [EXTENSION, "causal_conv1d", "fla.ops.gated_delta_rule"]
    loaded, problems = [], []
    for module in modules:
        if module == "causal_conv1d" and EXTENSION not in loaded:
            continue  # the package imports the extension: the same error again says nothing new
        try:
            importlib.import_module(module)
            loaded.append(module)
        except (ImportError, OSError) as e:
            problems.append(explain_import_error(module, e))
    details = {"loaded": loaded}
    if problems:
        return CheckResult("import", FAIL, "; ".join(problems), details=details)
    return CheckResult("import", PASS, f"loaded {', '.join(loaded)}", details=details)


# ----------------------------------------------------------------------------------------------------
# 3. arch coverage
# ----------------------------------------------------------------------------------------------------
def visible_gpus() -> list[dict]:
    """[{"index", "name", "sm"}] for each CUDA device torch sees; [] without one."""
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        out.append({"index": i, "name": torch.cuda.get_device_name(i), "sm": major * 10 + minor})
    return out


def recorded_arches(rec: dict) -> list[int]:
    arches = (rec.get("record") or {}).get("arches") or rec.get("label", {}).get("arches") or []
    return sorted({parse_sm(a) for a in arches})


def _target_hint(sm: int) -> str:
    """Name a target in targets.toml that builds this arch, if the file is at hand."""
    try:
        from wheelbuilder.targets import load

        names = [t.name for t in load().targets.values() if any(a.sm == sm for a in t.arches)]
    except Exception:  # targets.toml is not shipped in every install; the hint is optional
        names = []
    arch = f"{sm // 10}.{sm % 10}"
    return f"make wheels TARGET={names[0]}" if names else f"add a target with arch {arch} to targets.toml and make wheels"


def check_arch(so_path: str | None = None, gpus: list[dict] | None = None,
               expected: list[int] | None = None) -> CheckResult:
    """Read the extension's fatbin and compare its arches with every visible GPU, or without a GPU
    with the expected arches (--expect-arch / DFLASH_EXPECT_ARCHES / the wheel's build record)."""
    if so_path is None:
        spec = importlib.util.find_spec(EXTENSION)
        if spec is None or not spec.origin:
            return CheckResult("arch", FAIL, f"{EXTENSION} is not installed; {PACKAGE_FIX['causal_conv1d']}")
        so_path = spec.origin
    try:
        from wheelbuilder.fatbin import arch_summary, covers
    except ImportError as e:
        return CheckResult("arch", SKIP, f"cannot read fatbins: wheelbuilder.fatbin is unavailable ({e})")
    try:
        summary = arch_summary(so_path)
    except Exception as e:  # not an ELF, no .nv_fatbin, truncated file: all mean the .so is not usable
        return CheckResult("arch", FAIL, f"cannot read the fatbin of {so_path}: {type(e).__name__}: {e}; {WHEEL_FIX}",
                           details={"so": so_path})
    has = (f"SASS {', '.join(f'sm_{s}' for s in summary.get('sass', [])) or 'none'}; "
           f"PTX {', '.join(f'sm_{s}' for s in summary.get('ptx', [])) or 'none'}")
    details = {"so": so_path, "summary": summary}
    if not summary.get("sass") and not summary.get("ptx"):  # runs on no GPU at all, whatever is expected
        return CheckResult("arch", FAIL, f"{so_path} holds no device code at all ({has}): it was compiled "
                           f"without a -gencode arch or its fatbin was stripped; {WHEEL_FIX}", details=details)
    if gpus is None:
        gpus = visible_gpus()
    if gpus:
        details["gpus"] = gpus
        wanted = [(f"GPU {g['index']} ({g['name']})", g["sm"]) for g in gpus]
        source = "visible GPUs"
    else:
        if expected is None:
            expected = recorded_arches(build_record())
        if not expected:
            return CheckResult("arch", PASS, f"no GPU visible and no expected arch known; the extension holds {has}",
                               details=details)
        details["expected"] = expected
        wanted = [(f"expected arch {sm // 10}.{sm % 10}", sm) for sm in expected]
        source = "no GPU visible; expected arches"
    problems = []
    for who, sm in wanted:
        ok, why = covers(summary, sm)
        if not ok:
            problems.append(f"{who} is {sm_name(sm)}; {why} Fix: {_target_hint(sm)}")
    if problems:
        return CheckResult("arch", FAIL, "; ".join(problems), details=details)
    needs = ", ".join(sorted({sm_name(sm) for _, sm in wanted}))
    return CheckResult("arch", PASS, f"{source} need {needs}; the extension holds {has}", details=details)


# ----------------------------------------------------------------------------------------------------
# 4. dispatch
# ----------------------------------------------------------------------------------------------------
def dispatch_row(fn: KernelFunction) -> dict:
    """One kernel function as the report's details list it."""
    impl = fn.implementation
    return {"function": fn.attr, "kernel": fn.name, "package": fn.package, "fast": fn.fast,
            "implementation": f"{impl.__module__}.{impl.__qualname__}"}


def check_dispatch(modules: tuple[str, ...] = QWEN35_MODULES) -> CheckResult:
    """Every kernel function of the model modules resolved to its package's kernel (read by
    dflash.model.kernels.kernel_functions, the same reader the trainer's routing uses)."""
    import transformers

    from dflash.model.kernels import kernel_functions

    found, problems = [], []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except Exception as e:
            problems.append(f"{name} does not import ({type(e).__name__}: {e})")
            continue
        funcs = [dispatch_row(fn) for fn in kernel_functions(module)]
        if not funcs:
            problems.append(f"found no kernel-dispatched function in {name} (transformers {transformers.__version__}); "
                            "its dispatch mechanism changed: update dflash/model/target.py:kernel_functions")
        found += funcs
    slow = [f for f in found if not f["fast"]]
    details = {"transformers": transformers.__version__, "functions": found}
    if slow:
        fixes = sorted({PACKAGE_FIX.get(f["package"], f"install {f['package']}") for f in slow})
        problems.append(
            f"{len(slow)} of {len(found)} GatedDeltaNet kernel functions fall back to their reference PyTorch "
            f"implementation: {', '.join(f['kernel'] for f in slow)}; fix: {'; '.join(fixes)}")
    if problems:
        return CheckResult("dispatch", FAIL, "; ".join(problems), details=details)
    fast = ", ".join(f"{f['kernel']} -> {f['implementation']}" for f in found)
    return CheckResult("dispatch", PASS, f"all {len(found)} fast: {fast}", details=details)


# ----------------------------------------------------------------------------------------------------
# 6 (first half). Triton compiles a C launcher at first use: it needs a C compiler.
# ----------------------------------------------------------------------------------------------------
def find_c_compiler() -> str | None:
    """The compiler Triton would use: $CC, else gcc, else clang (triton/runtime/build.py, 3.6)."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc.split()[0])
    return shutil.which("gcc") or shutil.which("clang")
