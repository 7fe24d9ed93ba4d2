"""Audit a built wheel before it may enter dist/: does it hold what the target asked for, nothing else?

Checks, each reported with the value seen, the value expected and what to do:

    module    every extension module of the recipe is in the wheel (`<module>*.so`), built for the
              target's Python (`.cpython-311-...so`)
    arches    the module's fatbin holds SASS for exactly the target's arches and PTX exactly for the
              arches marked +PTX (a missing arch fails at run time, an extra one costs build time and size)
    needed    the module links torch (libc10.so, libc10_cuda.so, a libtorch*.so) and libcudart.so.<N>
              with N the CUDA major of the target's torch (another major cannot load beside torch)
    tags      the file name's tags are cp<py>-cp<py>-<platform>, the WHEEL file says the same
    version   the version is <recipe version>+<target local version>; METADATA Name/Version match
    build     the dist-info's wheelbuilder.json names the target's torch (and its arches, recipe)
    record    RECORD lists every file with its sha256 and size

`audit_wheel` runs them all and raises AuditError listing every failure at once.
"""

from __future__ import annotations

import email.parser
import re
import shutil
import tempfile
import zipfile
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging.tags import Tag
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from .errors import AuditError
from .fatbin import arch_summary, needed_libraries
from .targets import Arch, Recipe, Target
from .wheelfile import BUILD_INFO, dist_info_dir, read_build_info, verify_record

PLATFORM = "linux_x86_64"
TORCH_LIBS = ("libc10.so", "libc10_cuda.so")  # plus at least one libtorch*.so


@dataclass(frozen=True)
class Check:
    """One audited property: `seen` vs `expected`, and `fix` (what to do) when it failed."""

    name: str
    subject: str
    ok: bool
    seen: str
    expected: str
    fix: str = ""

    def line(self) -> str:
        text = f"[{self.name}] {self.subject}: seen {self.seen}; expected {self.expected}."
        return text + (f" Fix: {self.fix}" if not self.ok and self.fix else "")


@dataclass
class AuditReport:
    """The outcome of an audit. `modules` maps each audited .so (path in the wheel) to its arch
    summary ({"sass": [...], "ptx": [...]}) and DT_NEEDED list."""

    subject: str
    target: str | None
    checks: list[Check] = field(default_factory=list)
    modules: dict[str, dict] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    @property
    def arches(self) -> dict[str, list[int]]:
        """The union over all modules: {"sass": sorted SMs, "ptx": sorted SMs} (for manifest.json)."""
        return {kind: sorted({sm for m in self.modules.values() for sm in m["arches"][kind]})
                for kind in ("sass", "ptx")}

    def to_dict(self) -> dict:
        return {"subject": self.subject, "target": self.target, "ok": self.ok, "arches": self.arches,
                "modules": self.modules, "checks": [asdict(c) for c in self.checks]}

    def add(self, name: str, subject: str, ok: bool, seen, expected, fix: str = "") -> None:
        self.checks.append(Check(name, subject, bool(ok), str(seen), str(expected), fix))

    def raise_if_failed(self) -> "AuditReport":
        if not self.ok:
            lines = "\n".join(f"  - {c.line()}" for c in self.failures)
            raise AuditError(f"audit of {self.subject} failed {len(self.failures)} of {len(self.checks)} "
                             f"checks:\n{lines}")
        return self


def _sms(sms, suffix: str = "", only=()) -> str:
    """"sm_90, sm_120a": SMs in nvcc's spelling, `suffix` added to those in `only`."""
    return ", ".join(f"sm_{s}{suffix if s in only else ''}" for s in sms) or "none"


def check_arches(report: AuditReport, subject: str, summary: dict, arches: tuple[Arch, ...],
                 source: str = "targets.toml") -> None:
    """SASS exactly for `arches`, PTX exactly for those with ptx=True; `source`: the targets file."""
    want_sass = sorted({a.sm for a in arches})
    want_ptx = sorted({a.sm for a in arches if a.ptx})
    fix = ("the arch patch did not take effect, or the wrong arches were asked for: check the build log's "
           "-gencode flags and the recipe's arch_patch in " + source + ", then rebuild")
    # arch-specific code (sm_120a) runs on that exact GPU only: never what a target's "12.0" asks for
    seen_sass = _sms(summary["sass"], suffix="a", only=summary.get("arch_specific", ()))
    report.add("arches", f"{subject} SASS", seen_sass == _sms(want_sass), seen_sass, _sms(want_sass), fix)
    report.add("arches", f"{subject} PTX", summary["ptx"] == want_ptx, _sms(summary["ptx"]).replace("sm_", "compute_"),
               _sms(want_ptx).replace("sm_", "compute_"), fix + " (PTX comes only from arches written as X.Y+PTX)")


def check_needed(report: AuditReport, subject: str, needed: list[str], cuda_major: int,
                 source: str = "targets.toml") -> None:
    """Links torch's libraries and the CUDA runtime of torch's CUDA major."""
    missing = [lib for lib in TORCH_LIBS if lib not in needed]
    if not any(re.fullmatch(r"libtorch\w*\.so", lib) for lib in needed):
        missing.append("libtorch*.so")
    report.add("needed", f"{subject} torch libraries", not missing, ", ".join(needed) or "no DT_NEEDED",
               "libc10.so, libc10_cuda.so and a libtorch*.so",
               f"missing {', '.join(missing)}: the module was not built as a torch CUDA extension "
               "(torch.utils.cpp_extension.CUDAExtension); rebuild it with --no-build-isolation against "
               "the pinned torch")
    cudart = [lib for lib in needed if re.fullmatch(r"libcudart\.so(\.\d+)*", lib)]
    majors = [lib.split(".so.")[1].split(".")[0] for lib in cudart if ".so." in lib]
    ok = majors == [str(cuda_major)]
    report.add("needed", f"{subject} CUDA runtime", ok, ", ".join(cudart) or "no libcudart",
               f"libcudart.so.{cuda_major}",
               f"the CUDA toolkit that built it does not match torch's CUDA {cuda_major}: build with a CUDA "
               f"{cuda_major}.x toolkit (the target's toolkit in {source})")


def audit_so(path: Path | str, arches, *, cuda_major: int | None = None, report: AuditReport | None = None,
             subject: str | None = None, raise_on_failure: bool = True, source: str = "targets.toml") -> AuditReport:
    """Audit one compiled .so/.o: the fatbin holds exactly `arches` (Arch objects or "9.0+PTX" strings);
    with `cuda_major`, also its DT_NEEDED (torch libraries, libcudart.so.<cuda_major>)."""
    arches = tuple(a if isinstance(a, Arch) else Arch.parse(a) for a in arches)
    subject = subject or Path(path).name
    report = report if report is not None else AuditReport(subject=str(path), target=None)
    summary = arch_summary(path)
    needed = needed_libraries(path)
    report.modules[subject] = {"arches": {"sass": summary["sass"], "ptx": summary["ptx"]}, "needed": needed}
    check_arches(report, subject, summary, arches, source)
    if cuda_major is not None:
        check_needed(report, subject, needed, cuda_major, source)
    return report.raise_if_failed() if raise_on_failure else report


def find_modules(names: list[str], module: str) -> list[str]:
    """Wheel members that are the extension module `module` (dotted): `pkg/mod.cpython-311-...so`."""
    stem = module.replace(".", "/")
    return sorted(n for n in names if n.startswith(stem + ".") and n.endswith(".so") and "/" not in n[len(stem):])


def _check_module_abi(report: AuditReport, member: str, target: Target) -> None:
    m = re.search(r"\.cpython-(\d+)", member)
    want = target.python.replace(".", "")
    report.add("module", f"{member} Python ABI", m is None or m.group(1) == want,
               f"cpython-{m.group(1)}" if m else "no ABI suffix", f"cpython-{want}",
               f"built with the wrong Python: build with Python {target.python} "
               f"(the toolkit's python in {target.source})")


def _check_modules(report: AuditReport, zf: zipfile.ZipFile, target: Target, recipe: Recipe, tmp: Path) -> None:
    names = [n for n in zf.namelist() if not n.endswith("/")]
    for module in recipe.modules:
        found = find_modules(names, module)
        report.add("module", module, len(found) == 1, ", ".join(found) or "not in the wheel",
                   f"one {module.replace('.', '/')}*.so",
                   "the build did not compile the extension (look for 'skipping'/'error' in the build log) or "
                   f"the recipe's `modules` in {recipe.source} names the wrong module")
        for member in found:
            local = tmp / Path(member).name
            with zf.open(member) as src, open(local, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)  # large modules: stream, never hold them twice
            _check_module_abi(report, member, target)
            audit_so(local, target.arches, cuda_major=target.torch.cuda.major, report=report,
                     subject=member, raise_on_failure=False, source=target.source)


def _member_text(zf: zipfile.ZipFile, name: str) -> str:
    """A text file of the wheel; "" when absent (the check that reads it then fails, naming it)."""
    try:
        return zf.read(name).decode("utf-8", errors="replace")
    except KeyError:
        return ""


def _check_name_tags_version(report: AuditReport, zf: zipfile.ZipFile, wheel: Path, target: Target,
                             recipe: Recipe, platform: str) -> None:
    name, version, _build, tags = parse_wheel_filename(wheel.name)
    want_tag = Tag(target.cp_tag, target.cp_tag, platform)
    report.add("tags", wheel.name, tags == frozenset({want_tag}), ", ".join(sorted(map(str, tags))), str(want_tag),
               f"build with Python {target.python} on {platform}; a wheel with these tags would not install "
               "or not load")
    report.add("version", f"{wheel.name} name", name == canonicalize_name(recipe.name), name,
               canonicalize_name(recipe.name), "the wheel is of another project than the recipe")
    want_version = f"{recipe.version}+{target.local_version()}"
    report.add("version", f"{wheel.name} version", str(version) == want_version, version, want_version,
               "set the recipe env's local version ({local_version} -> " + target.local_version() + ") and rebuild"
               if version.public == Version(recipe.version).public else
               f"the sdist is not the pinned {recipe.name} {recipe.version}")
    dist_info = dist_info_dir([n for n in zf.namelist() if not n.endswith("/")], wheel.name)
    metadata = email.parser.Parser().parsestr(_member_text(zf, f"{dist_info}/METADATA"), headersonly=True)
    meta = (canonicalize_name(metadata.get("Name", "")), metadata.get("Version", ""))
    try:
        meta_ok = meta[0] == name and Version(meta[1]) == version
    except InvalidVersion:
        meta_ok = False
    report.add("version", f"{dist_info}/METADATA", meta_ok, f"Name {meta[0]}, Version {meta[1]}",
               f"Name {name}, Version {version}", "the wheel file was renamed after the build; rebuild instead")
    wheel_tags = email.parser.Parser().parsestr(_member_text(zf, f"{dist_info}/WHEEL")).get_all("Tag") or []
    renamed = sorted(wheel_tags) != sorted(map(str, tags))
    report.add("tags", f"{dist_info}/WHEEL", wheel_tags == [str(want_tag)], ", ".join(wheel_tags) or "no Tag",
               str(want_tag), "the wheel file was renamed after the build; rebuild instead" if renamed else
               f"build with Python {target.python} on {platform}")


def _check_build_info(report: AuditReport, wheel: Path, target: Target, recipe: Recipe) -> None:
    info = read_build_info(wheel)
    subject = f"{BUILD_INFO} torch"
    if info is None:
        report.add("build", subject, False, "no " + BUILD_INFO, target.torch.version,
                   "repack the wheel with wheelfile.repack_deterministic(extra_files={'" + BUILD_INFO + "': ...})")
        return
    report.add("build", subject, info.get("torch") == target.torch.version, info.get("torch"), target.torch.version,
               "the wheel was built against another torch; rebuild it in the target's builder (make wheels)")
    if "arches" in info:
        want = [str(a) for a in target.arches]
        report.add("build", f"{BUILD_INFO} arches", info["arches"] == want, info["arches"], want,
                   "the wheel was built for other arches; rebuild it for this target")
    if isinstance(info.get("recipe"), dict):
        seen = (info["recipe"].get("version"), info["recipe"].get("sha256"))
        report.add("build", f"{BUILD_INFO} recipe", seen == (recipe.version, recipe.sha256), "%s sha256 %s" % seen,
                   f"{recipe.version} sha256 {recipe.sha256}", "the wheel was built from another source; rebuild it")


def audit_wheel(wheel_path: Path | str, target: Target, recipe: Recipe, *, platform: str = PLATFORM,
                raise_on_failure: bool = True) -> AuditReport:
    """Run every check on a built wheel; raise AuditError listing each failure (seen vs expected, fix)."""
    wheel = Path(wheel_path)
    if not wheel.is_file():
        raise AuditError(f"wheel {wheel} does not exist; the build wrote nothing there. Check the build log.")
    try:
        parse_wheel_filename(wheel.name)
    except InvalidWheelFilename as e:
        raise AuditError(f"{wheel.name} is not a wheel file name ({e}); audit the .whl the build produced.") from None
    report = AuditReport(subject=wheel.name, target=target.name)
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise AuditError(f"{wheel} is not a zip archive ({e}); the file is damaged, rebuild it.") from None
    try:
        with zf, tempfile.TemporaryDirectory(prefix="audit-") as tmp:
            _check_name_tags_version(report, zf, wheel, target, recipe, platform)
            _check_modules(report, zf, target, recipe, Path(tmp))
        _check_build_info(report, wheel, target, recipe)
        problems = verify_record(wheel)
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:  # a bad CRC, a damaged deflate stream, cut short
        raise AuditError(
            f"{wheel} is damaged: a member cannot be decompressed ({type(e).__name__}: {e}). The file was "
            "truncated or altered after the build (a copy that did not finish, a bad disk); rebuild it or "
            "copy it again, and compare its sha256 with manifest.json (`python -m wheelbuilder verify --dir DIR`)."
        ) from None
    report.add("record", "RECORD", not problems, "; ".join(problems) or "all files hashed",
               "every file listed with its sha256 and size",
               "the archive was changed after the build; repack it with wheelfile.repack_deterministic")
    return report.raise_if_failed() if raise_on_failure else report

