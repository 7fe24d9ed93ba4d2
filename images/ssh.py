"""One SSH connection to a host (paramiko): log in, run commands, and an SFTP channel for files.

Why paramiko rather than the `ssh`/`rsync` binaries: SFTP gives byte offsets, a callback per chunk and
POSIX rename with no shell quoting of file names; host keys are checked against known_hosts in-process
with a strict policy; failures arrive as typed exceptions, which become one TransferError (exit 10) or
HostKeyError (exit 11) naming the host, the port and the fix.
"""

from __future__ import annotations

import logging
import re
import shlex
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import paramiko

from common.errors import ConfigurationError

from .errors import HostKeyError, TransferError

# paramiko's transport thread logs every failure with its traceback (logger "paramiko.transport"); with no
# handler anywhere, Python's last-resort handler printed them to stderr ahead of this module's message.
# Each failure reaches the caller as an exception, which says it once; a program that configures logging
# still gets paramiko's records.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

@dataclass(frozen=True)
class RunResult:
    argv: str
    rc: int
    stdout: str
    stderr: str


def parse_target(target: str) -> tuple[str, str]:
    """'root@pve' -> ('root', 'pve'); a bare host means root (pct needs root). A port written into the
    host (root@pve:2223, root@[::1]:2223) is refused: it goes to --port, and would otherwise be looked up
    as part of the host name."""
    user, _, host = target.rpartition("@")
    if not host:
        raise TransferError(f"--host '{target}' names no host; use USER@HOST, e.g. root@pve.")
    m = re.fullmatch(r"\[(.+)\]:(\d*)", host) or (re.fullmatch(r"([^:]+):(\d*)", host))
    if m:
        name, port = m.groups()
        raise ConfigurationError(
            f"--host '{target}' puts a port into the host; the port goes to its own option: "
            f"--host {user or 'root'}@{name} --port {port or 'PORT'}.")
    if host.startswith("["):  # [::1] without a port: the brackets are not part of the address
        raise ConfigurationError(f"--host '{target}': write an IPv6 address without brackets "
                                 f"({host.strip('[]')}); the port goes to --port.")
    return user or "root", host


class SshHost:
    """One SSH connection to a host: run commands, and an SFTP channel for files."""

    def __init__(self, target: str, *, port: int = 22, identity: str | None = None,
                 known_hosts: str | None = None, accept_new_host_key: bool = False,
                 compress: bool = False, timeout: float = 15.0):
        self.user, self.hostname = parse_target(target)
        self.port = port
        self.client = paramiko.SSHClient()
        known = Path(known_hosts or Path.home() / ".ssh" / "known_hosts").expanduser()
        if known_hosts is None:
            try:
                self.client.load_system_host_keys()
            except OSError:
                pass
        if known.exists():
            self.client.load_host_keys(str(known))
        elif accept_new_host_key:
            known.parent.mkdir(parents=True, exist_ok=True)
            known.touch()
            self.client.load_host_keys(str(known))
        # Unknown keys are refused unless asked; a *changed* key is always refused by paramiko
        # (BadHostKeyException), like OpenSSH's StrictHostKeyChecking=accept-new.
        self.client.set_missing_host_key_policy(
            paramiko.AutoAddPolicy() if accept_new_host_key else paramiko.RejectPolicy())
        try:
            self.client.connect(self.hostname, port=port, username=self.user, key_filename=identity,
                                timeout=timeout, compress=compress, allow_agent=identity is None,
                                look_for_keys=identity is None)
        except paramiko.BadHostKeyException as e:
            raise HostKeyError(
                f"the host key of {self.hostname}:{port} does not match the one in {known} ({e}). This may "
                "be an attack or a reinstalled host; check it and fix known_hosts (ssh-keygen -R HOST)."
            ) from None
        except paramiko.SSHException as e:
            if "not found in known_hosts" in str(e):
                raise HostKeyError(
                    f"{self.hostname}:{port} is not in {known}, so its identity cannot be checked. Add its key "
                    f"(ssh -p {port} {target} once, or ssh-keyscan) or pass --accept-new-host-key to trust "
                    "and record it on first use."
                ) from None
            if "protocol banner" in str(e):  # something listens there, but not sshd
                raise TransferError(
                    f"{self.hostname} port {port} answered, but not as an SSH server ({e}: it closed the "
                    "connection or sent no SSH greeting). Check --port: which port does sshd listen on there "
                    "(Port in /etc/ssh/sshd_config, `ss -tlnp` on the host)?") from None
            raise TransferError(f"SSH to {target} port {port} failed: {e}") from None
        except socket.gaierror as e:
            raise TransferError(f"cannot resolve the host name '{self.hostname}' ({e.strerror or e}); check "
                                "--host (USER@HOST), or use the host's IP address.") from None
        except (TimeoutError, OSError) as e:
            raise TransferError(f"cannot connect to {target} port {port}: {e}. Is sshd running there, on "
                                f"port {port}?") from None
        if accept_new_host_key:
            self.client.save_host_keys(str(known))
        self._sftp: paramiko.SFTPClient | None = None

    @property
    def sftp(self) -> paramiko.SFTPClient:
        if self._sftp is None:
            with self.talking("opening an SFTP channel"):
                self._sftp = self.client.open_sftp()
        return self._sftp

    @property
    def connected(self) -> bool:
        transport = self.client.get_transport()
        return transport is not None and transport.is_active()

    @contextmanager
    def talking(self, doing: str, after: str = "Run the command again."):
        """Turn what paramiko raises when the connection drops (EOFError, OSError 'Socket is closed',
        SSHException) or the host refuses an SFTP request (an OSError) into a TransferError that says which."""
        try:
            yield
        except TransferError:
            raise
        except (paramiko.SSHException, EOFError, OSError) as e:
            if isinstance(e.__context__, KeyboardInterrupt):  # it failed while an interruption unwound
                raise e.__context__ from None
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if not self.connected:
                raise TransferError(
                    f"the SSH connection to {self.hostname} closed while {doing} ({why}): sshd restarted, the "
                    f"host rebooted or the network dropped. {after}") from None
            raise TransferError(f"on {self.hostname}: {doing} failed ({why}).") from None

    def run(self, argv: list[str] | str, *, check: bool = True, stdin: bytes | None = None,
            timeout: float | None = None) -> RunResult:
        """Run a command on the host (a list is quoted for the remote shell). A connection that drops
        before the command has reported its exit status is a TransferError, whatever `check` says."""
        cmd = argv if isinstance(argv, str) else shlex.join(argv)
        with self.talking(f"running `{cmd}`"):
            chan_in, chan_out, chan_err = self.client.exec_command(cmd, timeout=timeout)
            if stdin is not None:
                chan_in.write(stdin)
            chan_in.channel.shutdown_write()
            out = chan_out.read().decode(errors="replace")
            err = chan_err.read().decode(errors="replace")
            rc = chan_out.channel.recv_exit_status()
        if rc == -1 and not self.connected:  # the channel closed with the connection, no exit status sent
            printed = (err or out).strip()[-400:]
            raise TransferError(
                f"the SSH connection to {self.hostname} closed while `{cmd}` ran, before it reported an exit "
                f"status: sshd restarted, the host rebooted or the network dropped. "
                f"{'It had printed: ' + printed + '. ' if printed else ''}Run the command again.")
        if check and rc != 0:
            how = f"exited with {rc}" if rc != -1 else "ended without an exit status (killed by a signal there?)"
            raise TransferError(f"on {self.hostname}: `{cmd}` {how}: {(err or out).strip()[-800:]}")
        return RunResult(cmd, rc, out, err)

    def abort(self) -> None:
        """Drop the connection at once, without SFTP's goodbyes (after an interruption mid-request)."""
        self._sftp = None
        self.client.close()

    def close(self) -> None:
        if self._sftp is not None:
            try:
                self._sftp.close()
            except (paramiko.SSHException, EOFError, OSError):  # the connection is gone already
                pass
        self.client.close()

    def __enter__(self) -> "SshHost":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):  # Ctrl-C, SIGTERM: no goodbyes
            self.abort()
        else:
            self.close()
