"""Find and check the toolchain a build will use: CUDA_HOME/nvcc, torch, Python, host compiler, and
how many compile jobs the machine can afford.

All checks run before anything is downloaded or compiled, so a wrong toolchain fails in seconds with
a message that says what to do instead.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from .errors import ConfigurationError, ToolchainError
from .targets import Target

GIB = 1 << 30
# Peak resident memory of one nvcc/cicc job on causal-conv1d-sized sources (flash-attn PR #2079
# measured 3-5 GB per thread on larger kernels; 3 GB is ample here and keeps 2-core machines busy).
MEM_PER_JOB = 3 * GIB


@dataclass(frozen=True)
class DetectedToolchain:
    """The toolchain found on this machine and checked against a target (check_toolchain)."""

    cuda_home: Path
    nvcc_version: Version
    torch_version: str
    torch_cuda: Version
    python: str
    cxx: str


def pip_cuda_home() -> Path | None:
    """site-packages/nvidia/cu13 when NVIDIA's CUDA 13 wheels (nvidia-cuda-nvcc etc.) are installed."""
    spec = importlib.util.find_spec("nvidia")
    if not spec or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        for cand in sorted(Path(root).glob("cu1*"), reverse=True):
            if (cand / "bin" / "nvcc").exists():
                return cand
    return None


def prepare_pip_cuda_home(home: Path) -> list[str]:
    """Make the pip layout usable as CUDA_HOME for torch.utils.cpp_extension (docs/architecture.md, "Build targets"):
    it looks in lib64 and links -lcudart, which the wheels ship only as lib/ and libcudart.so.13."""
    made = []
    if not (home / "lib64").exists():
        (home / "lib64").symlink_to("lib")
        made.append("lib64 -> lib")
    libs = sorted((home / "lib").glob("libcudart.so.*"))
    if libs and not (home / "lib" / "libcudart.so").exists():
        (home / "lib" / "libcudart.so").symlink_to(libs[0].name)
        made.append(f"lib/libcudart.so -> {libs[0].name}")
    return made


def header_roots(cuda_home: Path) -> list[Path]:
    """The header trees whose files can reach a cubin's line table: CUDA's (with CCCL) and torch's."""
    roots = [(cuda_home / "include").resolve()]
    spec = importlib.util.find_spec("torch")
    if spec and spec.origin:
        roots.append(Path(spec.origin).parent / "include")
    return [r for r in roots if r.is_dir()]


def clamp_mtimes(roots: list[Path], epoch: int) -> int:
    """Set every regular file under `roots` newer than `epoch` to `epoch`; returns how many changed.

    With -lineinfo, ptxas writes the mtime and size of each file that contributed device code (the
    .cu and headers such as torch's Half.h or CCCL's cub/block/*.cuh) into the cubin's line table, so
    headers installed by pip carry the time their layer was built into .nv_fatbin (README
    "Reproducibility", tests/test_reproducible_nvcc.py). Run in the builder stage only: it rewrites
    the toolkit's and torch's files."""
    changed = 0
    for root in roots:
        for path in root.rglob("*"):
            st = path.lstat()
            if path.is_file() and not path.is_symlink() and st.st_mtime > epoch:
                os.utime(path, (epoch, epoch))
                changed += 1
    return changed


def default_cuda_candidates() -> list[Path]:
    candidates: list[Path] = []
    if os.environ.get("CUDA_HOME"):  # absolute: pip compiles in the unpacked source, not in this directory
        candidates.append(Path(os.environ["CUDA_HOME"]).expanduser().absolute())
    pip_home = pip_cuda_home()
    if pip_home:
        candidates.append(pip_home)
    candidates.append(Path("/usr/local/cuda"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(os.path.realpath(nvcc)).parent.parent)
    return candidates


def find_cuda_home(candidates: list[Path] | None = None) -> Path:
    """CUDA_HOME from the environment, NVIDIA's pip wheels, /usr/local/cuda or nvcc on PATH."""
    for home in default_cuda_candidates() if candidates is None else candidates:
        if (home / "bin" / "nvcc").exists():
            return home
    raise ToolchainError(
        "no CUDA toolkit found: nvcc is not in $CUDA_HOME, NVIDIA's pip wheels, /usr/local/cuda or on PATH. "
        "A native build needs nvcc on this machine; to build without one, use the builder image: "
        "`make wheels TARGET=<target>` (Docker)."
    )


def nvcc_version(cuda_home: Path) -> Version:
    nvcc = cuda_home / "bin" / "nvcc"
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True)
    except OSError as e:  # not executable, a directory, an interpreter line pointing nowhere
        raise ToolchainError(
            f"{nvcc} cannot be run ({e.strerror or e}). Make it executable (chmod +x {nvcc}), or point "
            "CUDA_HOME at a complete CUDA toolkit, or build in Docker with `make wheels TARGET=<target>`."
        ) from None
    m = re.search(r"release (\d+\.\d+), V(\d+\.\d+\.\d+)", out.stdout)
    if out.returncode != 0 or not m:
        raise ToolchainError(f"{cuda_home}/bin/nvcc --version failed or printed no release: {out.stdout}{out.stderr}")
    return Version(m.group(2))


def cxx_version() -> str:
    cxx = os.environ.get("CXX", "c++")
    if not shutil.which(cxx):
        raise ToolchainError(f"no C++ compiler '{cxx}' on PATH; install g++ (Debian: apt-get install g++).")
    return subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]


def system_packages(cxx: str | None = None) -> dict[str, str]:
    """{package: version} of the distribution packages whose files go into the objects besides nvcc's
    and torch's: the C++ compiler proper, libstdc++'s and libc's headers, Python's headers, the
    assembler and linker (binutils). A wheel's
    bytes depend on them, so the manifest records them. {} where there is no dpkg (not Debian/Ubuntu)."""
    import sysconfig

    cxx = cxx or os.environ.get("CXX", "c++")
    if not shutil.which("dpkg-query") or not shutil.which(cxx):
        return {}

    def ask(*args: str) -> str:
        out = subprocess.run([cxx, *args], capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""

    # The assembler and linker too: gas computes the DWARF 5 location views in .debug_loclists.
    tools = [ask(f"-print-prog-name={tool}") for tool in ("as", "ld")]
    tools = [t if os.path.isabs(t) else (shutil.which(t) or "") for t in tools]
    probes = [ask("-print-prog-name=cc1plus"), ask("-print-file-name=libstdc++.so"), "/usr/include/stdio.h",
              str(Path(sysconfig.get_paths()["include"]) / "Python.h"), *tools]
    owners: set[str] = set()
    for probe in filter(None, probes):
        for path in dict.fromkeys([probe, os.path.realpath(probe)]):
            out = subprocess.run(["dpkg-query", "-S", path], capture_output=True, text=True)
            if out.returncode == 0:
                # "libc6-dev:amd64: /usr/include/stdio.h" (several owners are comma-separated)
                owners.update(p.strip().split(":")[0] for p in out.stdout.split(": ")[0].split(","))
                break
    if not owners:
        return {}
    out = subprocess.run(["dpkg-query", "-W", "-f", "${Package}\t${Version}\n", *sorted(owners)],
                         capture_output=True, text=True)
    return dict(line.split("\t", 1) for line in out.stdout.splitlines() if "\t" in line)


def installed_torch() -> tuple[str, Version | None]:
    """(torch.__version__, torch.version.cuda) of this interpreter, without importing torch twice."""
    try:
        import torch
    except ImportError:
        raise ToolchainError(
            f"torch is not installed in {sys.executable}. A native build compiles against the target's "
            "exact torch: install it from locks/<lock>/builder.txt, or build in Docker with `make wheels`."
        ) from None
    return torch.__version__, Version(torch.version.cuda) if torch.version.cuda else None


def check_toolchain(target: Target, cuda_candidates: list[Path] | None = None) -> DetectedToolchain:
    """Every check that can fail before the expensive part; returns the resolved toolchain."""
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    if py != target.python:
        raise ToolchainError(
            f"target {target.name} builds for Python {target.python}, but this is Python {py} ({sys.executable}). "
            f"Run with python{target.python}, or use `make wheels TARGET={target.name}` (Docker)."
        )
    if importlib.util.find_spec("pip") is None:
        raise ToolchainError(
            f"pip is not installed in {sys.executable}; the build runs `pip wheel`. Install it with "
            f"`{sys.executable} -m ensurepip` (a venv made by `uv venv` needs `--seed`)."
        )
    torch_version, torch_cuda = installed_torch()
    if Version(torch_version).public != target.torch.public or torch_cuda is None:
        raise ToolchainError(
            f"target {target.name} pins torch {target.torch.version} (CUDA {target.torch.cuda}), but this "
            f"interpreter has torch {torch_version} (CUDA {torch_cuda}). A C++ extension only works with the torch "
            f"minor it was built against; install the pinned torch (locks/{target.torch.lock}/builder.txt)."
        )
    if (torch_cuda.major, torch_cuda.minor) != (target.torch.cuda.major, target.torch.cuda.minor):
        raise ToolchainError(
            f"torch {torch_version} is built for CUDA {torch_cuda}, the target expects CUDA {target.torch.cuda}; "
            f"install torch from {target.torch.index}."
        )
    home = find_cuda_home(cuda_candidates)
    nvcc = nvcc_version(home)
    if nvcc.major != torch_cuda.major:
        raise ToolchainError(
            f"nvcc at {home} is CUDA {nvcc}, torch {torch_version} is CUDA {torch_cuda}: the major versions differ "
            "and torch.utils.cpp_extension refuses that. Point CUDA_HOME at a CUDA "
            f"{torch_cuda.major}.x toolkit, or pick a target whose torch matches this nvcc."
        )
    for arch in target.arches:
        if Version(f"{nvcc.major}.{nvcc.minor}") < arch.min_cuda():
            raise ToolchainError(
                f"nvcc {nvcc} at {home} cannot compile arch {arch} (needs CUDA >= {arch.min_cuda()}). "
                "Use a newer toolkit or drop the arch."
            )
    return DetectedToolchain(home, nvcc, torch_version, torch_cuda, py, cxx_version())


def mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * GIB


def plan_jobs(cores: int | None = None, mem: int | None = None, files: int = 4) -> tuple[int, int]:
    """(MAX_JOBS, NVCC_THREADS) sized from cores and free memory.

    Each nvcc job with T threads compiles T arches at once, each costing ~MEM_PER_JOB; the total
    thread count is kept <= cores and total memory <= 80 % of what is available."""
    cores = cores or os.cpu_count() or 1
    budget = max(1, int((mem if mem is not None else mem_available()) * 0.8 // MEM_PER_JOB))
    workers = max(1, min(cores, budget))
    jobs = max(1, min(files, workers))
    threads = max(1, workers // jobs)
    jobs = _env_count("MAX_JOBS", jobs, cores, "parallel compile jobs")
    threads = _env_count("NVCC_THREADS", threads, cores, "threads per nvcc job")
    if jobs * threads > cores:
        print(f"wheelbuilder: warning: MAX_JOBS={jobs} x NVCC_THREADS={threads} = {jobs * threads} compile "
              f"threads on {cores} CPU cores; they will compete for the CPU and each costs ~"
              f"{MEM_PER_JOB // GIB} GB of memory (the compiler may be killed). Unset both to let the build size "
              "them from cores and memory.", file=sys.stderr)
    return jobs, threads


def _env_count(name: str, default: int, cores: int, what: str) -> int:
    """A positive whole number from the environment (MAX_JOBS, NVCC_THREADS), else `default`."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigurationError(
            f"{name}={raw!r} is not a positive whole number of {what}. Set e.g. {name}={min(default, cores)} "
            f"(this machine has {cores} CPU cores), or unset it to let the build choose."
        )
    return value
