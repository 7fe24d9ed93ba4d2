"""The Docker engine: find a CLI that can build with BuildKit, make sure an engine runs, and hand out
a `docker` SDK client for everything that is not a build.

Builds go through the CLI (`DOCKER_BUILDKIT=1 docker build`: the SDK cannot drive BuildKit); waiting
for health, reading labels, saving and inspecting images go through the SDK's engine API.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import time
from pathlib import Path

from common.cmd import echo, run
from wheelbuilder.errors import ToolchainError
from common.fsutil import LOGS

from .errors import EngineError


def _client_version(cli: str) -> tuple[int, int]:
    out = subprocess.run([cli, "version", "--format", "{{.Client.Version}}"], capture_output=True, text=True)
    parts = (out.stdout.strip() or "0.0").split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return 0, 0


@functools.cache
def docker_cli() -> str:
    """A docker CLI that can run BuildKit builds.

    CLIs from 23.0 on hand BuildKit builds to the buildx plugin and fail without it; older CLIs (such
    as Debian's docker.io 20.10) have BuildKit built in. `$DOCKER` wins if set."""
    if os.environ.get("DOCKER"):
        return os.environ["DOCKER"]
    candidates = []
    for d in os.environ.get("PATH", "").split(os.pathsep):
        c = Path(d) / "docker"
        if c.is_file() and os.access(c, os.X_OK) and str(c.resolve()) not in [str(Path(x).resolve()) for x in candidates]:
            candidates.append(str(c))
    for cli in candidates:
        if subprocess.run([cli, "buildx", "version"], capture_output=True).returncode == 0:
            return cli
        if _client_version(cli) < (23, 0):
            return cli
    raise ToolchainError(
        "no docker CLI that can build with BuildKit: "
        + (f"{', '.join(candidates)} need(s) the buildx plugin. " if candidates else "docker is not installed. ")
        + "Install docker-buildx (or Debian's docker.io), or set DOCKER=/path/to/docker."
    )


def client():
    """A docker SDK client for the engine API (raises EngineError naming the fix if none answers)."""
    import docker

    try:
        c = docker.from_env(timeout=600)
        c.ping()
        return c
    except Exception as e:  # docker.errors.DockerException and socket errors alike
        raise EngineError(
            f"no Docker engine answers ({e}). Start one (`make engine` does, as root: Debian's docker.io, "
            "dockerd --bridge=none --iptables=false) or set DOCKER_HOST."
        ) from None


def engine_running() -> bool:
    try:
        client()
        return True
    except EngineError:
        return False


def ensure_engine(wait_s: float = 60.0) -> None:
    """Start a Docker engine if none runs: as root, install Debian's docker.io if missing and start
    dockerd without a bridge network (containers use --network none/host; nothing reaches a
    private-range address). Otherwise say what to do."""
    if engine_running():
        return
    if os.geteuid() != 0:
        raise EngineError("no Docker engine runs and starting one needs root: start dockerd (or Docker Desktop), then retry.")
    if not shutil.which("dockerd"):
        echo("installing Debian's docker.io (dockerd with built-in BuildKit)")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        run(["apt-get", "update", "-qq"], env=env, error=EngineError)
        run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "docker.io"], env=env, error=EngineError)
    LOGS.mkdir(exist_ok=True)
    log = open(LOGS / "dockerd.log", "ab")
    echo(f"starting dockerd --bridge=none --iptables=false (log: {LOGS / 'dockerd.log'})")
    subprocess.Popen(["dockerd", "--bridge=none", "--iptables=false"], stdout=log, stderr=log,
                     stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if engine_running():
            return
        time.sleep(1)
    raise EngineError(f"dockerd did not answer within {wait_s:.0f} s; see {LOGS / 'dockerd.log'}.")


GIB = 1024**3
# A target's first build: its torch layer (~5 GB unpacked) plus the ~3 GB of wheels pip downloads for
# it. Once an image of that torch lock exists, the layer is cached and a build adds little.
FIRST_BUILD_GIB = 10.0
CACHED_BUILD_GIB = 2.0


def ensure_free_space(torch_lock: str, what: str) -> None:
    """Fail before a build, with the numbers, when Docker's data root cannot hold it (rather than with
    `No space left on device` halfway through a multi-GB layer). DFLASH_MIN_FREE_GIB overrides the need."""
    if os.environ.get("DOCKER_HOST", "unix://").split("://")[0] not in ("unix", ""):
        return  # a remote engine: its disk is not this machine's to read
    root = client().info().get("DockerRootDir") or "/var/lib/docker"
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return
    cached = bool(client().images.list(filters={"label": f"io.dflash.torch-lock={torch_lock}"}))
    need = float(os.environ.get("DFLASH_MIN_FREE_GIB") or (CACHED_BUILD_GIB if cached else FIRST_BUILD_GIB))
    if free < need * GIB:
        why = "torch's layer is cached" if cached else f"torch {torch_lock} and its CUDA libraries are not cached yet"
        raise EngineError(
            f"Docker's data root {root} has {free / GIB:.1f} GiB free; building {what} needs about "
            f"{need:.0f} GiB ({why}). Free space (`docker image prune`, `docker builder prune`) or move "
            "dockerd's data-root to a larger disk; DFLASH_MIN_FREE_GIB=<GiB> overrides this check."
        )


def image_exists(ref: str) -> bool:
    import docker

    try:
        client().images.get(ref)
        return True
    except docker.errors.ImageNotFound:
        return False


def ca_bundle() -> str | None:
    """The CA bundle builds must trust (a TLS-intercepting proxy's CA travels as a BuildKit secret)."""
    for var in ("DFLASH_CA_BUNDLE", "PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        if os.environ.get(var) and Path(os.environ[var]).is_file():
            return os.environ[var]
    default = Path("/etc/ssl/certs/ca-certificates.crt")
    return str(default) if default.is_file() else None
