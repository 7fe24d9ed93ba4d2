"""Build a target's wheels: check -> fetch -> patch -> compile -> repack -> audit -> publish.

Nothing reaches the output directory until the wheel has passed its audit; an interrupted or failed
build leaves only its staging directory (removed on the way out) and its log.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import recipes as rcp
from common.cmd import echo, run
from .cxx_standard import check_cxx_standard
from .errors import BuildError, ConfigurationError
from common.fsutil import exclusive, sha256_file, source_date_epoch
from .targets import Recipe, Target
from .toolkit import DetectedToolchain, check_toolchain, pip_cuda_home, plan_jobs, prepare_pip_cuda_home
from .toolkit import system_packages as distro_packages

DEFAULT_BUILD_ROOT = Path("/tmp/wheelbuilder")


@dataclass(frozen=True)
class Plan:
    """What a build will do, printable before it starts (`--dry-run`)."""

    target: str
    recipes: list[str]
    arches: list[str]
    local_version: str
    python: str
    torch: str
    cuda_home: str
    nvcc: str
    max_jobs: int
    nvcc_threads: int
    build_dir: str
    out_dir: str
    source_date_epoch: int

    def describe(self) -> str:
        rows = [(k, ", ".join(v) if isinstance(v, list) else str(v)) for k, v in asdict(self).items()]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def make_plan(target: Target, out_dir: Path, build_root: Path, toolchain: DetectedToolchain,
              jobs_threads: tuple[int, int] | None = None) -> Plan:
    jobs, threads = jobs_threads or plan_jobs(files=4)
    return Plan(
        target=target.name, recipes=[f"{r.name} {r.version}" for r in target.recipes],
        arches=[str(a) for a in target.arches], local_version=target.local_version(),
        python=toolchain.python, torch=f"{toolchain.torch_version} (CUDA {toolchain.torch_cuda})",
        cuda_home=str(toolchain.cuda_home), nvcc=str(toolchain.nvcc_version), max_jobs=jobs,
        nvcc_threads=threads, build_dir=str(build_root), out_dir=str(out_dir),
        source_date_epoch=source_date_epoch(),
    )


class _Progress:
    """Turns ninja's `[k/N] ...` lines into a progress bar; everything else goes only to the log."""

    NINJA = re.compile(r"^\[(\d+)/(\d+)\]")

    def __init__(self, label: str):
        from tqdm import tqdm

        # On a terminal a bar; in a log or a docker build's plain output, one line per compiled object.
        self.tty = sys.stderr.isatty()
        self.bar = tqdm(total=None, desc=label, unit="obj", file=sys.stderr, dynamic_ncols=True, disable=not self.tty)
        self.label = label
        self.killed = False

    def __call__(self, line: str) -> None:
        if (m := self.NINJA.match(line)) and not self.tty:
            echo(f"{self.label}: compiling object {m.group(1)}/{m.group(2)}: {line.split()[-1][-60:]}")
        elif m:
            self.bar.total = int(m.group(2))
            self.bar.n = int(m.group(1)) - 1
            self.bar.set_postfix_str(line.split()[-1][-40:])
            self.bar.refresh()
        if "Killed" in line or "signal 9" in line or "std::bad_alloc" in line:
            self.killed = True

    def close(self) -> None:
        self.bar.close()


def nvcc_fixed_flags(recipe: Recipe) -> list[str]:
    """nvcc flags that take process ids out of the objects (README "Reproducibility").

    -objtemp names nvcc's intermediate files after the object instead of tmpxft_<pid>_..., whose pid
    otherwise lands in .nv_fatbin. -frandom-seed replaces the process id of nvcc's front end (cudafe++),
    which it appends to the module id, and so to every `_INTERNAL_<hash>_<len>_<file>_<hash>` name, in
    a translation unit that defines no non-template external function or variable (all three of
    causal-conv1d's .cu files). Without it the number follows how many processes ran before, which
    MAX_JOBS, --threads and the machine's load change. The module id keeps the file's name, so one
    seed per recipe still gives each file its own internal names (nvcc 13.0.88)."""
    return ["-objtemp", f"-frandom-seed={recipe.dist_name}-{recipe.version}"]


def compile_recipe(recipe: Recipe, target: Target, toolchain: DetectedToolchain, plan: Plan, src: Path, stage: Path,
                   log: Path) -> Path:
    """pip wheel --no-build-isolation --no-deps in the patched tree; returns the raw wheel."""
    env = dict(os.environ)
    env.update(rcp.recipe_env(recipe, target))
    env.update({
        "CUDA_HOME": str(toolchain.cuda_home),
        "PATH": f"{toolchain.cuda_home}/bin:{env.get('PATH', '')}",
        "MAX_JOBS": str(plan.max_jobs),
        "NVCC_THREADS": str(plan.nvcc_threads),
        "SOURCE_DATE_EPOCH": str(plan.source_date_epoch),
        "NVCC_APPEND_FLAGS": " ".join([*env.get("NVCC_APPEND_FLAGS", "").split(), *nvcc_fixed_flags(recipe)]),
        "PIP_NO_INPUT": "1",
        "PYTHONHASHSEED": "0",
    })
    env.pop("TORCH_CUDA_ARCH_LIST", None)  # the arch patch decides; an inherited list would only confuse
    if shutil.which("ccache") and not (os.environ.get("WHEELBUILDER_NO_CCACHE") or os.environ.get("CCACHE_DISABLE")):
        # nvcc through torch's PYTORCH_NVCC hook; the host compiler through ccache's masquerade
        # directory (CXX="ccache c++" would break torch's compiler version check).
        env["PYTORCH_NVCC"] = f"ccache {toolchain.cuda_home}/bin/nvcc"
        if Path("/usr/lib/ccache").is_dir():
            env["PATH"] = f"/usr/lib/ccache:{env['PATH']}"
    raw = stage / "raw"
    raw.mkdir()
    progress = _Progress(f"{recipe.name} {target.local_version()}")
    started = time.monotonic()
    try:
        run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-cache-dir",
             "--disable-pip-version-check", "-v", "-w", str(raw), str(src)],
            cwd=src, env=env, log=log, on_line=progress, quiet=False)
    except BuildError:
        if progress.killed:
            raise BuildError(
                f"the compiler was killed, most likely for lack of memory (MAX_JOBS={plan.max_jobs}, "
                f"NVCC_THREADS={plan.nvcc_threads}). Retry with fewer parallel jobs, e.g. "
                f"`MAX_JOBS=1 NVCC_THREADS=1 make wheels TARGET={target.name}`. Log: {log}"
            ) from None
        raise
    finally:
        progress.close()
    echo(f"compiled {recipe.name} in {time.monotonic() - started:.0f} s")
    wheels = sorted(raw.glob("*.whl"))
    if len(wheels) != 1:
        raise BuildError(f"expected one wheel from {recipe.name}, found {[w.name for w in wheels]}. Log: {log}")
    return wheels[0]


def check_directory(path: Path, option: str) -> None:
    """Refuse (also in a dry run) a directory option that names a file, or one below a file: the
    build would otherwise fail on its first mkdir, after the plan has printed."""
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                kind = "a file" if p.is_file() else "not a directory"
                what = f"is {kind}" if p == path else f"lies below {p}, which is {kind}"
                raise ConfigurationError(f"{option} {path} {what}; it must be a directory. Give a directory "
                                         "(it is created when missing), or move the file out of the way.")
            return


def build_target(target: Target, out_dir: Path, *, build_root: Path = DEFAULT_BUILD_ROOT,
                 log_dir: Path | None = None, dry_run: bool = False) -> list[dict]:
    """Build every recipe of `target` into `out_dir`; returns the manifest entries written."""
    for option, path in (("--out", out_dir), ("--build-dir", build_root), ("--log-dir", log_dir)):
        if path is not None:
            check_directory(path, option)
    jobs_threads = plan_jobs(files=4)  # MAX_JOBS / NVCC_THREADS checked before anything slower
    source_date_epoch()
    toolchain = check_toolchain(target)
    plan = make_plan(target, out_dir, build_root, toolchain, jobs_threads)
    echo(f"build plan for {target.name}:\n{plan.describe()}")
    if dry_run:
        return []
    if toolchain.cuda_home == pip_cuda_home():  # NVIDIA's pip wheels: add the links cpp_extension needs
        for made in prepare_pip_cuda_home(toolchain.cuda_home):
            echo(f"prepared {toolchain.cuda_home}: {made}")
    from . import manifest
    from .audit import audit_wheel
    from .wheelfile import build_info, repack_deterministic

    log_dir = log_dir or out_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    system_packages = distro_packages()
    # The source tree under build_root is locked too: two builds with different --out but one
    # --build-dir would otherwise delete each other's objects mid-compile.
    with exclusive(out_dir), exclusive(build_root / target.name, "build"):
        for recipe in target.recipes:
            started = time.monotonic()
            log = log_dir / f"{recipe.key}.log"
            log.write_text(f"wheelbuilder: {recipe.name} {recipe.version} for {target.name}\n{plan.describe()}\n")
            echo(f"log: {log}")
            sdist = rcp.fetch_sdist(recipe)
            src = rcp.unpack(sdist, build_root / target.name / f"{recipe.dist_name}-{recipe.version}")
            for edit in rcp.apply_patches(src, recipe, target.arches):
                echo(f"patched {edit}")
            stage = rcp.stage_dir(out_dir, ".staging-")
            try:
                raw = compile_recipe(recipe, target, toolchain, plan, src, stage, log)
                cxx_standard = check_cxx_standard(src, recipe, target)
                info = build_info(target, recipe, nvcc=str(toolchain.nvcc_version), cxx_standard=cxx_standard,
                                  local_version=target.local_version(), source_date_epoch=plan.source_date_epoch)
                wheel = repack_deterministic(raw, stage, extra_files={"wheelbuilder.json": info},
                                             source_date_epoch=plan.source_date_epoch)
                report = audit_wheel(wheel, target, recipe)
                final = out_dir / wheel.name
                os.replace(wheel, final)  # same filesystem: atomic
            finally:
                shutil.rmtree(stage, ignore_errors=True)
            record = manifest.entry_for(
                final, recipe=recipe.name, recipe_version=recipe.version, source_url=recipe.url,
                source_sha256=recipe.sha256, target=target.name, arches=report.arches,
                toolchain=manifest.ToolchainRecord(nvcc=str(toolchain.nvcc_version), torch=toolchain.torch_version,
                                             python=platform.python_version(), host_compiler=toolchain.cxx,
                                             system_packages=system_packages),
                build_seconds=round(time.monotonic() - started, 1), source_date_epoch=plan.source_date_epoch)
            manifest.write_manifest(out_dir, [record])
            echo(f"wrote {final.name}  {final.stat().st_size / 1e6:.1f} MB  sha256 {sha256_file(final)}")
            entries.append(record)
    return entries
