"""A second Docker engine on this machine: "the GPU box" an image travels to, empty at the start."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


def start(root: Path, namespace: str = "dflash-loopback") -> tuple[subprocess.Popen, str]:
    """(process, DOCKER_HOST) of a second dockerd listening on ROOT/docker.sock: no bridge, no iptables, its
    own data and exec roots under ROOT and its own containerd `namespace`. Keep ROOT short: a unix socket
    path holds at most 108 bytes. Stop it with terminate() and wait(); ROOT is the caller's to remove."""
    sock = root / "docker.sock"
    log = root / "dockerd.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["dockerd", "--bridge=none", "--iptables=false", "--ip6tables=false", f"--data-root={root / 'data'}",
             f"--exec-root={root / 'exec'}", f"--pidfile={root / 'dockerd.pid'}", f"--host=unix://{sock}",
             f"--containerd-namespace={namespace}", f"--containerd-plugins-namespace={namespace}-plugins"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if subprocess.run(["docker", "-H", f"unix://{sock}", "version"], capture_output=True).returncode == 0:
            return proc, f"unix://{sock}"
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the second dockerd did not start: {log.read_text()[-1500:]}")
