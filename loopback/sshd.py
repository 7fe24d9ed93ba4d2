"""A real OpenSSH server on 127.0.0.1 with throwaway host and user keys.

The server runs as the current user (root for the tests and benchmarks that log in as root), accepts only
the user key generated here, serves SFTP (internal-sftp), and sets `env` (PATH included) for every login."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from loopback.net import free_port, stop, wait_listening

SSHD = "/usr/sbin/sshd"
LOGIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # PATH of a login unless `env` sets one


@dataclass
class LoopbackSshd:
    port: int
    target: str  # root@127.0.0.1
    identity: Path  # private user key
    known_hosts: Path  # holds the server's host key
    workdir: Path
    proc: subprocess.Popen

    def sessions(self) -> list[int]:
        """Pids of the per-connection processes this sshd has forked (they serve the SSH sessions and SFTP)."""
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
        """SIGKILL every per-connection process: to a client, the connection closes mid-way (sshd
        restarted, the host rebooted). Returns the pids it killed."""
        killed = self.sessions()
        for pid in killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return killed

    def stop(self) -> None:
        stop(self.proc)


def available() -> str | None:
    """None when a loopback sshd can run here, else why not."""
    if not Path(SSHD).exists():
        return "sshd is not installed (apt-get install openssh-server)"
    if not shutil.which("ssh-keygen"):
        return "ssh-keygen is not installed (apt-get install openssh-client)"
    return None


def start(workdir: Path, env: dict[str, str] | None = None, config: str = "") -> LoopbackSshd:
    """sshd on a free loopback port, accepting only a user key generated in `workdir`; `env` becomes SetEnv
    lines of every login (PATH defaults to LOGIN_PATH); `config` is appended to sshd_config as it is
    (AllowUsers, ForceCommand, a Match block: the misbehaving servers of the fault tests)."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(workdir / name)], check=True)
    (workdir / "authorized_keys").write_text((workdir / "user_key.pub").read_text())
    os.chmod(workdir / "authorized_keys", 0o600)
    Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation directory sshd insists on
    port = free_port()
    login_env = {"PATH": LOGIN_PATH, **(env or {})}
    setenv = " ".join(f'"{k}={v}"' for k, v in login_env.items())
    (workdir / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {workdir}/host_key\n"
        f"AuthorizedKeysFile {workdir}/authorized_keys\nPidFile {workdir}/sshd.pid\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "UsePAM no\nStrictModes no\nSubsystem sftp internal-sftp\n"
        f"SetEnv {setenv}\n" + config
    )
    host_pub = (workdir / "host_key.pub").read_text().split()
    (workdir / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
    log = workdir / "sshd.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(workdir / "sshd_config")], stdout=out,
                                stderr=subprocess.STDOUT)
    wait_listening(port, proc, log, "sshd", 10)
    return LoopbackSshd(port, "root@127.0.0.1", workdir / "user_key", workdir / "known_hosts", workdir, proc)
