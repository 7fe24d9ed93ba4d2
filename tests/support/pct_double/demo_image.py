"""A small demo image with the shape of dflash-train (venv on PATH, ENV, WORKDIR, ENTRYPOINT) for the
export, LXC and push tests. Built FROM dflash-base:bookworm when the engine has it (`python -m images
base`), else from a tiny busybox rootfs imported on the spot (a few seconds)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

DEMO_TAG = "dflash-export-demo:test"
BUSYBOX_TAG = "dflash-test-busybox:1"

DOCKERFILE = """FROM {base}
RUN mkdir -p /opt/venv/bin /workspace \\
 && printf '#!/bin/sh\\necho "demo-train VIRTUAL_ENV=$VIRTUAL_ENV PWD=$(pwd) ARGS=$*"\\n' > /opt/venv/bin/dflash-train \\
 && printf '#!/bin/sh\\necho "doctor: all checks passed VIRTUAL_ENV=$VIRTUAL_ENV PWD=$(pwd) ARGS=$*"\\n' > /opt/venv/bin/dflash \\
 && chmod +x /opt/venv/bin/dflash-train /opt/venv/bin/dflash \\
 && ln /opt/venv/bin/dflash /opt/venv/bin/dflash-hardlink
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LD_LIBRARY_PATH=/opt/venv/lib
WORKDIR /workspace
LABEL io.dflash.target=cu130-sm120
ENTRYPOINT ["dflash-train"]
"""


def _busybox_base(client) -> str:
    busybox = shutil.which("busybox")
    if not busybox:
        raise RuntimeError("neither dflash-base:bookworm nor busybox (apt install busybox-static) is available")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "tmp", "proc", "sys", "dev", "root"):
            ti = tarfile.TarInfo(d)
            ti.type, ti.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(ti)
        tar.add(busybox, "bin/busybox")
        applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
        for applet in applets:
            if applet != "busybox":
                ti = tarfile.TarInfo(f"bin/{applet}")
                ti.type, ti.linkname = tarfile.SYMTYPE, "busybox"
                tar.addfile(ti)
        for name, text in (("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"), ("etc/group", "root:x:0:\n"),
                           ("etc/os-release", "ID=busybox\nNAME=busybox\n")):
            ti = tarfile.TarInfo(name)
            ti.size = len(text)
            tar.addfile(ti, io.BytesIO(text.encode()))
    subprocess.run(["/usr/bin/docker", "import", "-", BUSYBOX_TAG], input=buf.getvalue(), check=True,
                   capture_output=True)
    return BUSYBOX_TAG


def demo_image() -> str:
    """Tag of the demo image, built once per engine (reused while its base does not change)."""
    import docker

    client = docker.from_env()
    names = {t for img in client.images.list() for t in img.tags}
    base = "dflash-base:bookworm" if "dflash-base:bookworm" in names else (
        BUSYBOX_TAG if BUSYBOX_TAG in names else _busybox_base(client))
    with tempfile.TemporaryDirectory() as ctx:
        Path(ctx, "Dockerfile").write_text(DOCKERFILE.format(base=base))
        subprocess.run(["/usr/bin/docker", "build", "--network=host", "-q", "-t", DEMO_TAG, ctx], check=True,
                       capture_output=True, env={**os.environ, "DOCKER_BUILDKIT": "1"})
    return DEMO_TAG


def demo_image_or_skip() -> str:
    """demo_image() for a fixture: skips the test with the reason when no engine can build it (the
    conftest turns that skip into a failure where the docker tier is required)."""
    import pytest

    pytest.importorskip("docker")
    try:
        return demo_image()
    except Exception as e:
        pytest.skip(f"cannot build the demo image: {e}")


PUBLISH_DOCKERFILE = """FROM {demo}
COPY sbom.cdx.json /opt/dflash/sbom.cdx.json
RUN printf '{marker}\\n' > /opt/dflash/revision \\
 && printf '#!/bin/sh\\nif [ "$1" = doctor ]; then\\n  if [ "$2" = --fail ]; then echo "doctor: FAIL demo check"; exit 1; fi\\n  echo "doctor: all checks passed ARGS=$*"; exit 0\\nfi\\nexec dflash-train "$@"\\n' > /usr/local/bin/dflash-entry \\
 && chmod +x /usr/local/bin/dflash-entry
ENTRYPOINT ["dflash-entry"]
LABEL org.opencontainers.image.title=dflash-train org.opencontainers.image.revision={revision} \\
      io.dflash.target=cu130-sm120 io.dflash.torch-lock=cu130 io.dflash.wheel-sha256={wheel} \\
      io.dflash.sbom=/opt/dflash/sbom.cdx.json
"""


def labelled_demo_image(tag: str, revision: str = "0123456789abcdef0123") -> str:
    """The demo image with the runtime image's labels, an SBOM, and an entrypoint that answers `doctor`
    like the real one (`doctor --fail` fails, for the tests of a failing verdict) (made by images.sbom from the host venv
    and locks/cu130): what `publish` and `push-docker` need, in seconds. Another `revision` gives another
    image (a different layer), for the tests of tags that point elsewhere."""
    import hashlib

    from images import sbom

    demo = demo_image()
    repo = Path(__file__).resolve().parents[3]
    with tempfile.TemporaryDirectory() as ctx:
        sbom.main(["--locks", str(repo / "locks" / "cu130"), "--out", str(Path(ctx, "sbom.cdx.json"))])
        wheel = hashlib.sha256(revision.encode()).hexdigest()
        Path(ctx, "Dockerfile").write_text(PUBLISH_DOCKERFILE.format(demo=demo, revision=revision, wheel=wheel,
                                                                     marker=revision))
        subprocess.run(["/usr/bin/docker", "build", "--network=host", "-q", "-t", tag, ctx], check=True,
                       capture_output=True, env={**os.environ, "DOCKER_BUILDKIT": "1"})
    return tag


PYTHON_TAG = "dflash-export-python:test"
PYTHON_DOCKERFILE = """FROM dflash-base:bookworm
RUN apt-get update -qq \\
 && apt-get install -y -qq --no-install-recommends python3 \\
 && rm -rf /var/lib/apt/lists/* \\
 && python3 -m venv --without-pip /opt/venv \\
 && useradd --create-home --uid 1000 --shell /bin/sh dflash
COPY bin/ /opt/venv/bin/
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    PYTHONPATH={repo} PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1
USER dflash
WORKDIR /home/dflash
"""
# The console scripts of the runtime image's venv that the LXC tests call.
PYTHON_SCRIPTS = {"dflash": "dflash.cli:main", "dflash-train": "dflash.cli:train_main",
                  "torchrun": "torch.distributed.run:main"}


def python_image() -> str:
    """An image shaped like the runtime image where it matters to multi-process work inside LXC: Debian
    bookworm's minimal base with no init, no iproute2 and no net-tools, Debian's python3 (3.11) in a venv at
    /opt/venv, a non-root user `dflash`, the `dflash`, `dflash-train` and `torchrun` scripts. Its
    site-packages stay empty: the containers bind-mount this machine's venv (torch, datasets,
    transformers: cp311 wheels, several GB a copy would cost) there, and the source tree at its own path
    (PYTHONPATH). Needs dflash-base:bookworm (bootstrapped when missing, as `make image` does) and the
    Debian mirror for python3."""
    import docker

    from images.base import DEFAULT_TAG, bootstrap

    client = docker.from_env()
    names = {t for img in client.images.list() for t in img.tags}
    if DEFAULT_TAG not in names:
        bootstrap()
    repo = Path(__file__).resolve().parents[3]
    with tempfile.TemporaryDirectory() as ctx:
        Path(ctx, "Dockerfile").write_text(PYTHON_DOCKERFILE.format(repo=repo))
        Path(ctx, "bin").mkdir()
        for name, entry in PYTHON_SCRIPTS.items():
            module, func = entry.split(":")
            script = Path(ctx, "bin", name)
            script.write_text(f"#!/opt/venv/bin/python3\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
            script.chmod(0o755)
        proc = subprocess.run(["/usr/bin/docker", "build", "--network=host", "-q", "-t", PYTHON_TAG, ctx], check=False,
                              capture_output=True, text=True, env={**os.environ, "DOCKER_BUILDKIT": "1"})
        if proc.returncode != 0:
            raise RuntimeError(f"docker build of {PYTHON_TAG} failed: {proc.stderr.strip()[-800:]}")
    return PYTHON_TAG
