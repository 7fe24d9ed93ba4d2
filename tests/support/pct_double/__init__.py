"""Test doubles for a Proxmox host: `pct` (driving real LXC), `pvesh`, `pveversion` and `pvesm`, reached
through the loopback OpenSSH server of loopback.sshd."""

from __future__ import annotations

from pathlib import Path

from loopback import sshd

DOUBLE_DIR = Path(__file__).resolve().parent


def start_host(workdir: Path, env: dict[str, str] | None = None) -> sshd.LoopbackSshd:
    """A loopback 'Proxmox host': sshd whose login PATH starts with this directory, so `pct`, `pvesh`,
    `pveversion` and `pvesm` resolve to the doubles; `env` becomes SetEnv lines of every login."""
    return sshd.start(workdir, {"PATH": f"{DOUBLE_DIR}:{sshd.LOGIN_PATH}", **(env or {})})
