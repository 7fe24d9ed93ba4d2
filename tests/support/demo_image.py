"""Images for the tests: the demo image of loopback.demo_image or a skip, and python_image() for the LXC
tests of multi-process work."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path


def demo_image_or_skip() -> str:
    """loopback.demo_image.demo_image() for a fixture, FROM dflash-base:bookworm (bootstrapped when missing;
    where it cannot be, demo_image() takes a busybox rootfs): skips the test with the reasons when no engine
    can build it (the conftest turns that skip into a failure where the docker tier is required)."""
    import pytest

    pytest.importorskip("docker")
    from images.base import bootstrap
    from loopback.demo_image import demo_image

    try:
        bootstrap()  # dflash-base:bookworm, as `make image` makes it: root, debootstrap, the Debian mirror
        no_base = ""
    except Exception as e:  # not root, no mirror: a busybox rootfs may still do
        no_base = f" (bootstrapping dflash-base:bookworm failed: {e})"
    try:
        return demo_image()
    except Exception as e:
        pytest.skip(f"cannot build the demo image: {e}{no_base}")


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
    from images.base import bootstrap
    from images.engine import docker_cli

    bootstrap()
    repo = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as ctx:
        Path(ctx, "Dockerfile").write_text(PYTHON_DOCKERFILE.format(repo=repo))
        Path(ctx, "bin").mkdir()
        for name, entry in PYTHON_SCRIPTS.items():
            module, func = entry.split(":")
            script = Path(ctx, "bin", name)
            script.write_text(f"#!/opt/venv/bin/python3\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
            script.chmod(0o755)
        proc = subprocess.run([docker_cli(), "build", "--network=host", "-q", "-t", PYTHON_TAG, ctx], check=False,
                              capture_output=True, text=True, env={**os.environ, "DOCKER_BUILDKIT": "1"})
        if proc.returncode != 0:
            raise RuntimeError(f"docker build of {PYTHON_TAG} failed: {proc.stderr.strip()[-800:]}")
    return PYTHON_TAG
