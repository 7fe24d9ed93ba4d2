"""A test double of a native build: the real `wheelbuilder` command line, build loop, lock, staging and
subprocess wrapper, but no nvcc, torch check or download. The "sdist" unpacks to a setup.py that starts
a fake ninja, which starts two fake compilers the way ninja does (each in a process group of its own) and
writes "COMPILER COMPILER NINJA SETUP_PY" pids to $WHEELBUILDER_DOUBLE_PIDS; then the build hangs as a
long compile does, so a test can stop it mid-compile and check what is left behind.

The fake ninja stops its compilers only after it has caught the signal itself (it passes the signal on to
each job's process group a moment later and waits for them), and a fake compiler takes half a second to
exit on SIGTERM (nvcc removing its temporary files): pip, which dies at once, is long gone by then.

    python tests/support/wheelbuilder_double.py build --target cu130-sm120 --out OUT --build-dir BUILD

`install(monkeypatch.setattr)` applies the same replacements in-process, undone after the test.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from packaging.version import Version  # noqa: E402

COMPILER = '''\
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.5), sys.exit(1)))
time.sleep(300)
'''

NINJA = f'''\
import os, signal, subprocess, sys, time
jobs = [subprocess.Popen([sys.executable, "-S", "-c", {COMPILER!r}], process_group=0) for _ in range(2)]
def stop(signum, _frame):
    time.sleep(0.2)  # ninja notices between two polls of its jobs
    for job in jobs:
        os.killpg(job.pid, signum)
    for job in jobs:
        job.wait()
    sys.exit(1)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
with open(os.environ["WHEELBUILDER_DOUBLE_PIDS"], "w") as f:
    f.write(" ".join(str(p) for p in [*(j.pid for j in jobs), os.getpid(), os.getppid()]) + "\\n")
time.sleep(300)
'''

SETUP_PY = f'''\
import subprocess, sys, time
ninja = subprocess.Popen([sys.executable, "-S", "-c", {NINJA!r}])
print("[1/4] fake_kernel.o", flush=True)
time.sleep(300)
'''


def install(set_attr=setattr, cuda_home: Path | None = None) -> None:
    """Replace the toolchain check and the source steps of wheelbuilder.build with the double's."""
    from wheelbuilder import build
    from wheelbuilder.toolkit import DetectedToolchain

    home = cuda_home or Path(os.environ.get("WHEELBUILDER_DOUBLE_CUDA", "/nonexistent-cuda"))

    def check_toolchain(target, cuda_candidates=None):
        return DetectedToolchain(home, Version("13.0.88"), target.torch.version, target.torch.cuda,
                                 target.python, "c++ (double)")

    def fetch_sdist(recipe, cache=None):
        return Path(f"/nonexistent/{recipe.sdist}")

    def unpack(sdist, build_dir):
        build_dir.mkdir(parents=True, exist_ok=True)
        (build_dir / "setup.py").write_text(SETUP_PY)
        return build_dir

    set_attr(build, "check_toolchain", check_toolchain)
    set_attr(build.rcp, "fetch_sdist", fetch_sdist)
    set_attr(build.rcp, "unpack", unpack)
    set_attr(build.rcp, "apply_patches", lambda src, recipe, arches: [])
    set_attr(build, "distro_packages", lambda: {})


if __name__ == "__main__":
    install()
    from wheelbuilder.__main__ import main

    sys.exit(main(sys.argv[1:]))
