"""A small demo image with the shape of dflash-train (venv on PATH, ENV, WORKDIR, ENTRYPOINT), for the
export, LXC, push and publish tests and the push/publish benchmarks. Built FROM dflash-base:bookworm when
the engine has it (`python -m images base`), else from a tiny busybox rootfs (busybox-static from the host)
imported on the spot: seconds either way, and the build cache makes a repeat instant."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO_TAG = "dflash-loopback-demo:1"
BUSYBOX_TAG = "dflash-loopback-busybox:1"

# The demo's programs, as printf formats (`\n` is a newline): dflash-train and dflash echo what they see;
# the labelled image's entrypoint answers `doctor` (and fails `doctor --fail`), else runs dflash-train.
TRAIN = r'#!/bin/sh\necho "demo-train VIRTUAL_ENV=$VIRTUAL_ENV PWD=$(pwd) ARGS=$*"\n'
DOCTOR = r'#!/bin/sh\necho "doctor: all checks passed VIRTUAL_ENV=$VIRTUAL_ENV PWD=$(pwd) ARGS=$*"\n'
ENTRY = (r'#!/bin/sh\nif [ "$1" = doctor ]; then\n'
         r'  if [ "$2" = --fail ]; then echo "doctor: FAIL demo check"; exit 1; fi\n'
         r'  echo "doctor: all checks passed ARGS=$*"; exit 0\nfi\nexec dflash-train "$@"\n')

DOCKERFILE = f"""FROM {{base}}
RUN mkdir -p /opt/venv/bin /workspace \\
 && printf '{TRAIN}' > /opt/venv/bin/dflash-train \\
 && printf '{DOCTOR}' > /opt/venv/bin/dflash \\
 && chmod +x /opt/venv/bin/dflash-train /opt/venv/bin/dflash \\
 && ln /opt/venv/bin/dflash /opt/venv/bin/dflash-hardlink
ENV VIRTUAL_ENV=/opt/venv \\
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    LD_LIBRARY_PATH=/opt/venv/lib
WORKDIR /workspace
LABEL io.dflash.target=cu130-sm120
ENTRYPOINT ["dflash-train"]
"""

LABELLED_DOCKERFILE = f"""FROM {{demo}}
COPY sbom.cdx.json /opt/dflash/sbom.cdx.json
RUN printf '{{revision}}\\n' > /opt/dflash/revision \\
 && printf '{ENTRY}' > /usr/local/bin/dflash-entry \\
 && chmod +x /usr/local/bin/dflash-entry
ENTRYPOINT ["dflash-entry"]
LABEL org.opencontainers.image.title=dflash-train org.opencontainers.image.revision={{revision}} \\
      io.dflash.target=cu130-sm120 io.dflash.torch-lock=cu130 io.dflash.wheel-sha256={{wheel}} \\
      io.dflash.sbom=/opt/dflash/sbom.cdx.json
"""


def _build(tag: str, dockerfile: str, files: dict[str, Path] | None = None) -> str:
    from images.engine import docker_cli

    with tempfile.TemporaryDirectory() as ctx:
        Path(ctx, "Dockerfile").write_text(dockerfile)
        for name, path in (files or {}).items():
            shutil.copy(path, Path(ctx, name))
        subprocess.run([docker_cli(), "build", "--network=host", "-q", "-t", tag, ctx], check=True,
                       capture_output=True, env={**os.environ, "DOCKER_BUILDKIT": "1"})
    return tag


def _busybox_base() -> str:
    """A busybox rootfs (busybox-static from the host) imported as BUSYBOX_TAG."""
    from images.engine import docker_cli

    busybox = shutil.which("busybox")
    if not busybox:
        raise RuntimeError("neither dflash-base:bookworm (make base) nor busybox (apt install busybox-static) "
                           "is available")
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
    subprocess.run([docker_cli(), "import", "-", BUSYBOX_TAG], input=buf.getvalue(), check=True, capture_output=True)
    return BUSYBOX_TAG


def demo_image() -> str:
    """DEMO_TAG, built (or found in the build cache) FROM dflash-base:bookworm, else a busybox rootfs."""
    import docker

    names = {t for img in docker.from_env().images.list() for t in img.tags}
    base = "dflash-base:bookworm" if "dflash-base:bookworm" in names else (
        BUSYBOX_TAG if BUSYBOX_TAG in names else _busybox_base())
    return _build(DEMO_TAG, DOCKERFILE.format(base=base))


def labelled_demo_image(tag: str, revision: str = "0123456789abcdef0123") -> str:
    """The demo image as `tag`, with the runtime image's labels, an SBOM of locks/cu130 (images.sbom, from
    this venv) and an entrypoint that answers `doctor` like the real one (`doctor --fail` fails): what
    `publish` and `push-docker` need, in seconds. Another `revision` gives another image (a different
    layer), for tags that point elsewhere."""
    from images import sbom

    demo = demo_image()
    with tempfile.TemporaryDirectory() as tmp:
        sbom_file = Path(tmp, "sbom.cdx.json")
        sbom.main(["--locks", str(REPO / "locks" / "cu130"), "--out", str(sbom_file)])
        wheel = hashlib.sha256(revision.encode()).hexdigest()
        return _build(tag, LABELLED_DOCKERFILE.format(demo=demo, revision=revision, wheel=wheel),
                      {"sbom.cdx.json": sbom_file})
