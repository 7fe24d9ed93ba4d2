"""A real OpenSSH server on 127.0.0.1 with throwaway host and user keys, for the `ssh` test tier.

The server runs as the current user (root here, which `pct` needs), accepts only the generated user key,
and puts tests/support/pct_double/ first on the session PATH so `pct`, `pveversion` and `pvesm` resolve to the
doubles."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

DOUBLE_DIR = Path(__file__).resolve().parent


@dataclass
class LoopbackSshd:
    port: int
    target: str  # root@127.0.0.1
    identity: Path  # private user key
    known_hosts: Path  # holds the server's host key
    workdir: Path
    proc: subprocess.Popen

    def sessions(self) -> list[int]:
        """Pids of the per-connection processes this sshd has forked (they serve the sessions and SFTP)."""
        kids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:  # the process ended while we looked
                continue
            if int(fields[1]) == self.proc.pid:
                kids.append(int(stat.parent.name))
        return kids

    def drop_connections(self) -> list[int]:
        """SIGKILL every session process: to a client, the connection closes mid-way (sshd restarted,
        the host rebooted). Returns the pids it killed."""
        killed = self.sessions()
        for pid in killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return killed

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def available() -> str | None:
    """None when a loopback sshd can run here, else why not."""
    if not shutil.which("sshd", path="/usr/sbin:" + os.environ.get("PATH", "")):
        return "sshd is not installed (apt-get install openssh-server)"
    if not shutil.which("ssh-keygen"):
        return "ssh-keygen is not installed (apt-get install openssh-client)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(workdir: Path, env: dict[str, str] | None = None) -> LoopbackSshd:
    """Start sshd on a free loopback port; `env` becomes SetEnv lines of every session."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(workdir / name)], check=True)
    (workdir / "authorized_keys").write_text((workdir / "user_key.pub").read_text())
    os.chmod(workdir / "authorized_keys", 0o600)
    Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation directory sshd insists on
    port = _free_port()
    session_env = {"PATH": f"{DOUBLE_DIR}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   **(env or {})}
    setenv = " ".join(f'"{k}={v}"' for k, v in session_env.items())
    (workdir / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {workdir}/host_key\n"
        f"AuthorizedKeysFile {workdir}/authorized_keys\nPidFile {workdir}/sshd.pid\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "UsePAM no\nStrictModes no\nSubsystem sftp internal-sftp\n"
        f"SetEnv {setenv}\n"
    )
    host_pub = (workdir / "host_key.pub").read_text().split()
    (workdir / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
    proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(workdir / "sshd_config")],
                            stdout=open(workdir / "sshd.log", "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited: {(workdir / 'sshd.log').read_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return LoopbackSshd(port, "root@127.0.0.1", workdir / "user_key", workdir / "known_hosts", workdir, proc)
