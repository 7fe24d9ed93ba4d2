"""One SSH connection to a host (paramiko): log in, run commands, SFTP requests, each bounded in time.

Why paramiko rather than the `ssh`/`rsync` binaries: SFTP gives byte offsets, a callback per chunk and
POSIX rename with no shell quoting of file names; host keys are checked against known_hosts in-process
with a strict policy; failures arrive as typed exceptions, which become one TransferError (exit 10) or
HostKeyError (exit 11) naming the host, the port and the fix.

Two limits bound every wait, so a host that misbehaves ends in a message and never in a hang:

    --ssh-timeout S       the host may stay silent this long: the TCP connection, the SSH greeting, the key
                          exchange and the login together, opening a channel, each SFTP request, and the
                          upload between two acknowledgements
    --command-timeout C   each command on the host (pct, sha256sum, df, the doctor). It runs there under
                          coreutils' `timeout`, which stops it and its children after C seconds (nothing keeps
                          running on the host); this side gives up C + S seconds after starting it

paramiko's own waits for a channel request, a send window or an exit status have no limit, so the limits
are kept by a watchdog (images/watchdog.py) that closes the connection; every blocked call then returns.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import shlex
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import paramiko

from common.errors import ConfigurationError

from .errors import HostKeyError, TransferError
from .watchdog import Watchdog

# paramiko's transport thread logs every failure with its traceback (logger "paramiko.transport"); with no
# handler anywhere, Python's last-resort handler printed them to stderr ahead of this module's message.
# Each failure reaches the caller as an exception, which says it once; a program that configures logging
# still gets paramiko's records.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

SSH_TIMEOUT = 30.0  # seconds the host may stay silent
COMMAND_TIMEOUT = 900.0  # seconds one command may run on the host: a checksum of a 30 GB file on slow disks
KILL_AFTER = 10  # seconds between `timeout`'s SIGTERM and its SIGKILL on the host
BACKSTOP = 30.0  # paramiko's own timeouts, later than the watchdog's so that its message comes first
DEFAULT_KEYS = ("id_rsa", "id_dsa", "id_ecdsa", "id_ed25519")  # what paramiko's look_for_keys tries in ~/.ssh

T = TypeVar("T")


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


def bounded(cmd: str, limit: float) -> str:
    """`cmd` as sent: under coreutils' `timeout`, which ends it (and the processes it started, its process
    group) after `limit` seconds with exit status 124, or 137 when it had to use SIGKILL."""
    return f"timeout -k {KILL_AFTER} {limit:g} sh -c {shlex.quote(cmd)}"


def keys_tried(identity: str | None) -> str:
    """The keys a login offers, as a message names them."""
    if identity:
        return f"the key {identity}"
    found = [f"~/.ssh/{name}" for name in DEFAULT_KEYS if (Path.home() / ".ssh" / name).exists()]
    return "ssh-agent's keys" + (f" and {', '.join(found)}" if found else " (no key in ~/.ssh)")


class SshHost:
    """One SSH connection to a host: run commands, and an SFTP channel for files."""

    def __init__(self, target: str, *, port: int = 22, identity: str | None = None,
                 known_hosts: str | None = None, accept_new_host_key: bool = False,
                 compress: bool = False, ssh_timeout: float = SSH_TIMEOUT,
                 command_timeout: float = COMMAND_TIMEOUT):
        self.user, self.hostname = parse_target(target)
        self.port, self.identity = port, identity
        self.ssh_timeout, self.command_timeout = ssh_timeout, command_timeout
        if identity is not None and not Path(identity).expanduser().is_file():
            raise TransferError(f"--identity {identity} does not exist or is not a file; give the private key "
                                f"whose .pub is in {self.user}'s authorized_keys on {self.hostname}.")
        self.client = paramiko.SSHClient()
        self._sftp: paramiko.SFTPClient | None = None
        known = self._load_host_keys(known_hosts, accept_new_host_key)
        try:
            self._connect(known, compress)
        except BaseException:
            self._close_client()  # a refused or stalled login leaves no transport thread behind
            raise
        if accept_new_host_key:
            self.client.save_host_keys(str(known))

    def _load_host_keys(self, known_hosts: str | None, accept_new_host_key: bool) -> Path:
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
        return known

    def _connect(self, known: Path, compress: bool) -> None:
        """TCP, the SSH greeting, key exchange and login within --ssh-timeout, or one message saying why not."""
        where = f"{self.hostname} port {self.port}"
        try:
            sock = socket.create_connection((self.hostname, self.port), timeout=self.ssh_timeout)
        except socket.gaierror as e:
            raise TransferError(f"cannot resolve the host name '{self.hostname}' ({e.strerror or e}); check "
                                "--host (USER@HOST), or use the host's IP address.") from None
        except TimeoutError:
            raise TransferError(f"cannot connect to {where}: no answer within --ssh-timeout "
                                f"{self.ssh_timeout:g} s (the host is down, or a firewall drops the packets). "
                                "Check --host and --port.") from None
        except OSError as e:
            raise TransferError(f"cannot connect to {self.user}@{self.hostname} port {self.port}: {e}. Is sshd "
                                f"running there, on port {self.port}?") from None
        try:
            with self.watching(self.ssh_timeout, self._login_stalled):
                self.client.connect(
                    self.hostname, port=self.port, username=self.user, key_filename=self.identity, sock=sock,
                    timeout=self.ssh_timeout + BACKSTOP, banner_timeout=self.ssh_timeout + BACKSTOP,
                    auth_timeout=self.ssh_timeout + BACKSTOP, channel_timeout=self.ssh_timeout + BACKSTOP,
                    compress=compress, allow_agent=self.identity is None, look_for_keys=self.identity is None)
        except TransferError:
            raise
        except paramiko.BadHostKeyException as e:
            raise HostKeyError(
                f"the host key of {self.hostname}:{self.port} does not match the one in {known} ({e}). This may "
                "be an attack or a reinstalled host; check it and fix known_hosts (ssh-keygen -R HOST)."
            ) from None
        except paramiko.AuthenticationException as e:
            raise TransferError(self._login_refused(e)) from None
        except (paramiko.SSHException, EOFError, OSError) as e:
            if "not found in known_hosts" in str(e):  # RejectPolicy's refusal of an unknown host key
                raise HostKeyError(
                    f"{self.hostname}:{self.port} is not in {known}, so its identity cannot be checked. Add its key "
                    f"(ssh -p {self.port} {self.user}@{self.hostname} once, or ssh-keyscan) or pass "
                    "--accept-new-host-key to trust and record it on first use.") from None
            raise TransferError(self._handshake_failed(e)) from None

    def _login_stalled(self) -> str:
        transport = self.client.get_transport()
        stage = ("sent no SSH greeting" if transport is None or not transport.remote_version else
                 "stopped answering during the key exchange or the login")
        return (f"{self.hostname} port {self.port} accepted the connection but {stage} within --ssh-timeout "
                f"{self.ssh_timeout:g} s; the connection was closed. sshd there is stuck or overloaded, or "
                "something else holds the port (a proxy or firewall that accepts and then goes quiet). Check with "
                f"`ssh -v -p {self.port} {self.user}@{self.hostname}`, or raise --ssh-timeout on a slow link.")

    def _login_refused(self, e: paramiko.AuthenticationException) -> str:
        who = f"{self.hostname} port {self.port}"
        if isinstance(e, paramiko.PasswordRequiredException):
            return (f"the key {self.identity} is protected by a passphrase, which is never asked for here. Load it "
                    f"into ssh-agent (ssh-add {self.identity}) and leave out --identity, or use a key without one.")
        if isinstance(e, paramiko.BadAuthenticationType):
            return (f"{who} takes no key login for {self.user} (it offers only {', '.join(e.allowed_types)}), and "
                    "logins here use keys only. Allow public keys there (PubkeyAuthentication yes in "
                    f"/etc/ssh/sshd_config) and add yours to {self.user}'s authorized_keys.")
        pub = f"{self.identity}.pub" if self.identity else "~/.ssh/id_ed25519.pub"
        return (f"{who} refused the login as {self.user} with {keys_tried(self.identity)}. Add the public key to "
                f"{self.user}'s authorized_keys there (ssh-copy-id -i {pub} -p {self.port} "
                f"{self.user}@{self.hostname}), or pass --identity with a key it accepts. sshd answers the same "
                f"when {self.user} may not log in at all: see AllowUsers, DenyUsers and PermitRootLogin in "
                "/etc/ssh/sshd_config there (its log says which: journalctl -u ssh).")

    def _handshake_failed(self, e: Exception) -> str:
        where = f"{self.hostname} port {self.port}"
        if "protocol banner" in str(e):  # something listens there, but not sshd
            return (f"{where} answered, but not as an SSH server ({e}: it closed the connection or sent no SSH "
                    "greeting). Check --port: which port does sshd listen on there (Port in /etc/ssh/sshd_config, "
                    "`ss -tlnp` on the host)?")
        if "No authentication methods available" in str(e):
            return (f"no SSH key to log in to {where} as {self.user}: no --identity, nothing in ssh-agent and none "
                    f"of ~/.ssh/{{{','.join(DEFAULT_KEYS)}}}. Pass --identity with the private key whose .pub is in "
                    f"{self.user}'s authorized_keys there.")
        return f"SSH to {self.user}@{self.hostname} port {self.port} failed: {type(e).__name__}: {e}"

    @contextmanager
    def watching(self, limit: float, stalled: Callable[[], str]) -> Iterator[Watchdog]:
        """Bound the block: `limit` seconds without `progress()` on the yielded watchdog close the connection,
        and the block ends in TransferError(stalled()) whatever paramiko raised when its wait was cut."""
        dog = Watchdog(limit, self._drop_transport)
        with dog:
            try:
                yield dog
            except KeyboardInterrupt:
                raise
            except BaseException:
                if dog.fired:
                    raise TransferError(stalled()) from None
                raise
        if dog.fired:  # the last answer came as the watchdog closed the connection: it is gone all the same
            raise TransferError(stalled())

    def _drop_transport(self) -> None:
        """The watchdog's move (from its own thread): close the socket, waking every call blocked on it."""
        transport = self.client.get_transport()
        if transport is not None:
            transport.close()

    def stopped_answering(self, doing: str, after: str = "Run the command again.") -> str:
        return (f"{self.hostname} port {self.port} stopped answering while {doing}: nothing came back for "
                f"--ssh-timeout {self.ssh_timeout:g} s, so the connection was closed (the host is overloaded or "
                f"stuck, or the network path stalls). {after} Raise --ssh-timeout where the link pauses longer.")

    @property
    def sftp(self) -> paramiko.SFTPClient:
        if self._sftp is None:
            doing = "opening an SFTP channel"
            with self.talking(doing), self.watching(self.ssh_timeout, lambda: self.stopped_answering(doing)):
                self._sftp = self.client.open_sftp()
        return self._sftp

    def sftp_request(self, doing: str, request: Callable[[paramiko.SFTPClient], T]) -> T:
        """`request(sftp)`: one SFTP round trip, within --ssh-timeout."""
        sftp = self.sftp
        with self.talking(doing), self.watching(self.ssh_timeout, lambda: self.stopped_answering(doing)):
            return request(sftp)

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
        """Run a command on the host (a list is quoted for the remote shell) within `timeout` seconds
        (default: --command-timeout). A command that runs out of time, or a connection that drops before
        the command has reported its exit status, is a TransferError, whatever `check` says."""
        cmd = argv if isinstance(argv, str) else shlex.join(argv)
        limit = self.command_timeout if timeout is None else timeout
        started = time.monotonic()
        with self.talking(f"running `{cmd}`"), self.watching(limit + self.ssh_timeout,
                                                             lambda: self._no_exit_status(cmd, limit)):
            chan_in, chan_out, chan_err = self.client.exec_command(bounded(cmd, limit))
            if stdin is not None:
                chan_in.write(stdin)
            chan_in.channel.shutdown_write()
            out = chan_out.read().decode(errors="replace")
            err = chan_err.read().decode(errors="replace")
            rc = chan_out.channel.recv_exit_status()
        if rc in (124, 137) and time.monotonic() - started >= limit:
            raise TransferError(self._timed_out(cmd, limit, (err or out).strip()[-400:]))
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

    def _timed_out(self, cmd: str, limit: float, printed: str) -> str:
        return (f"`{cmd}` did not finish on {self.hostname} within --command-timeout {limit:g} s and was stopped "
                f"there. {'It had printed: ' + printed + '. ' if printed else ''}It hangs (a stuck storage "
                "mount, a locked container: look on the host) or the host is only slow: raise --command-timeout.")

    def _no_exit_status(self, cmd: str, limit: float) -> str:
        return (f"`{cmd}` on {self.hostname} port {self.port} reported no exit status within --command-timeout "
                f"{limit:g} s + --ssh-timeout {self.ssh_timeout:g} s, so the connection was closed. The host did not "
                "stop it (a ForceCommand runs instead of it, or the host cannot run `timeout`), so it may still run "
                "there, or the connection stalled: look on the host (ps -ef), or raise --command-timeout.")

    def abort(self) -> None:
        """Drop the connection at once, without SFTP's goodbyes (after an interruption mid-request)."""
        self._sftp = None
        self._close_client()

    def close(self) -> None:
        if self._sftp is not None:
            try:
                self._sftp.close()
            except (paramiko.SSHException, EOFError, OSError):  # the connection is gone already
                pass
        self._close_client()

    def _close_client(self) -> None:
        """Close the connection and wait for paramiko's transport thread to end (Transport.close only asks
        it to: its read loop notices within its 0.1 s socket timeout)."""
        transport = self.client.get_transport()
        self.client.close()
        if transport is not None and transport.is_alive():
            transport.join(5)

    def __enter__(self) -> "SshHost":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):  # Ctrl-C, SIGTERM: no goodbyes
            self.abort()
        else:
            self.close()


def seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"'{text}' is not a positive number of seconds")
    return value


def add_timeout_arguments(group) -> None:
    """--ssh-timeout and --command-timeout (see the module docstring) on a parser or argument group."""
    group.add_argument("--ssh-timeout", type=seconds, default=SSH_TIMEOUT, metavar="SECONDS",
                       help="give up when the host stays silent this long (login, SFTP, the upload)")
    group.add_argument("--command-timeout", type=seconds, default=COMMAND_TIMEOUT, metavar="SECONDS",
                       help="stop a command on the host (pct, sha256sum, the doctor) that runs longer")
