"""Send an artifact to a host over SSH: resumable, checksummed on the host, renamed into place atomically.

Why paramiko rather than the `ssh`/`rsync` binaries: SFTP gives byte offsets (stat the partial, append
from its size), a callback per chunk (tqdm progress with rate and ETA) and POSIX rename, with no shell
quoting of file names and no dependency on rsync being installed on the host; host keys are checked
against known_hosts in-process with a strict policy, and failures arrive as typed exceptions.

On the host, for a file NAME in DIR:

    DIR/.NAME.partial   grows while sending; kept when the client dies, so the next run appends to it
                        (after checking that its bytes are a prefix of the local file)
    DIR/NAME            appears only by `rename(.NAME.partial, NAME)` after `sha256sum` on the host
                        matched: a half-written or corrupt file never carries the real name
"""

from __future__ import annotations

import logging
import re
import shlex
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import paramiko
from tqdm import tqdm

from common.errors import ConfigurationError
from common.fsutil import sha256_file

from .errors import HostKeyError, TransferError

# paramiko's transport thread logs every failure with its traceback (logger "paramiko.transport"); with no
# handler anywhere, Python's last-resort handler printed them to stderr ahead of this module's message.
# Each failure reaches the caller as an exception, which says it once; a program that configures logging
# still gets paramiko's records.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

CHUNK = 1 << 20
SPACE_MARGIN = 64 << 20  # keep this much free on the host after the upload


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


@dataclass(frozen=True)
class TransferResult:
    remote_path: str
    status: str  # "sent", "resumed", "already-present"
    bytes_sent: int
    seconds: float
    sha256: str

    @property
    def rate_mb_s(self) -> float:
        return self.bytes_sent / 1e6 / self.seconds if self.seconds > 0 else 0.0


def local_sha256(path: Path, progress: bool) -> str:
    """sha256 of the local file, with a progress bar (hashing a multi-GB template takes a while)."""
    with tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=f"sha256 {path.name}",
              disable=not progress, leave=False) as bar:
        return sha256_file(path, progress=bar.update)


def remote_sha256(host: SshHost, path: str, limit: int | None = None) -> str:
    q = shlex.quote(path)
    cmd = f"head -c {int(limit)} {q} | sha256sum" if limit is not None else f"sha256sum {q}"
    return host.run(cmd).stdout.split()[0]


def remote_size(host: SshHost, path: str) -> int | None:
    try:
        return host.sftp.stat(path).st_size
    except FileNotFoundError:
        return None


def remote_free_bytes(host: SshHost, directory: str) -> int:
    out = host.run(["df", "-P", "-B1", directory]).stdout.splitlines()
    return int(out[-1].split()[3])


def send_file(host: SshHost, local: Path, remote_dir: str, *, sha256: str | None = None,
              force: bool = False, bwlimit_mb_s: float | None = None, progress: bool = True) -> TransferResult:
    """Upload `local` to `remote_dir/<name>`; see the module docstring for the protocol.

    `sha256`: the digest the file must have (from its export record); computed when None.
    `bwlimit_mb_s`: upload cap in MB/s (10**6 bytes per second). Raises TransferError before sending anything when the name is taken by a
    different file (without `force`) or the host lacks space."""
    local = Path(local)
    if not local.is_file():
        raise TransferError(f"{local} does not exist or is not a file; export the artifact first "
                            "(python -m images export) or give the path it was written to.")
    size = local.stat().st_size
    final = f"{remote_dir.rstrip('/')}/{local.name}"
    partial = f"{remote_dir.rstrip('/')}/.{local.name}.partial"
    start = time.monotonic()
    digest = sha256 or local_sha256(local, progress)
    # A dropped connection mid-way (sshd restarted, the network gone) is a TransferError, not a traceback.
    with host.talking(f"sending {local.name} to {remote_dir}", after=f"The host keeps what arrived in {partial}: "
                      "run the same command again and the upload resumes from there."):
        host.run(["mkdir", "-p", remote_dir])
        existing = remote_size(host, final)
        if existing is not None:
            theirs = remote_sha256(host, final)
            if theirs == digest:
                return TransferResult(final, "already-present", 0, time.monotonic() - start, digest)
            if not force:
                raise TransferError(
                    f"{host.hostname}:{final} already exists with different content (sha256 {theirs[:16]}..., "
                    f"{existing} bytes; ours {digest[:16]}..., {size} bytes). Pass --force to replace it, or "
                    "give the new artifact another name."
                )

        offset = remote_size(host, partial) or 0
        if offset > size or (offset and remote_sha256(host, partial, offset) != sha256_file(local, offset)):
            offset = 0  # not a prefix of this file (another version was being sent): start over
        needed = size - offset + SPACE_MARGIN
        free = remote_free_bytes(host, remote_dir)
        if free < needed:
            raise TransferError(
                f"{host.hostname}:{remote_dir} has {free / 1e9:.2f} GB free but the upload needs "
                f"{needed / 1e9:.2f} GB. Free space there or choose another storage."
            )

        _upload(host, local, partial, offset, size, bwlimit_mb_s, progress)

        if progress:
            tqdm.write(f"verifying sha256 of {local.name} on {host.hostname} ({size / 1e9:.2f} GB)")
        theirs = remote_sha256(host, partial)
        if theirs != digest:
            host.sftp.remove(partial)
            raise TransferError(
                f"checksum mismatch after upload: {host.hostname}:{partial} has sha256 {theirs}, expected "
                f"{digest}. The partial was deleted and nothing was renamed; check the local file "
                f"({local}) against its record and run again."
            )
        host.sftp.posix_rename(partial, final)  # atomic on one filesystem, replaces an old file (--force)
        return TransferResult(final, "resumed" if offset else "sent", size - offset,
                              time.monotonic() - start, digest)


def _upload(host: SshHost, local: Path, partial: str, offset: int, size: int,
            bwlimit_mb_s: float | None, progress: bool) -> None:
    """Append local[offset:] to the remote partial, pipelined, with tqdm rate and ETA."""
    t0 = time.monotonic()
    sent = 0
    dst = host.sftp.open(partial, "ab" if offset else "wb")
    try:
        with open(local, "rb") as src, tqdm(total=size, initial=offset, unit="B", unit_scale=True,
                                            unit_divisor=1024, desc=f"send {local.name}", disable=not progress) as bar:
            dst.set_pipelined(True)
            src.seek(offset)
            while block := src.read(CHUNK):
                dst.write(block)
                sent += len(block)
                bar.update(len(block))
                if bwlimit_mb_s:
                    ahead = sent / (bwlimit_mb_s * 1e6) - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
        dst.close()  # waits until the host has acknowledged every pipelined write
    except BaseException:
        # Interrupted (Ctrl-C, SIGTERM) or failed mid-write: the connection may hold half a request, and
        # closing the file politely would wait for acknowledgements that never come (or fail and hide the
        # interruption). Drop the connection: the host's SFTP server ends, keeping what it has written.
        host.abort()
        raise


def main_send(argv: list[str] | None = None) -> int:
    """`python -m images.transfer HOST FILE DIR [...]`: one upload (used by tests to kill a client).
    Errors print their message and exit with their code (images/errors.py): 10 transfer, 11 host key;
    Ctrl-C 130, SIGTERM 143 (the host keeps .NAME.partial, the next run resumes it)."""
    from common.cli import run_cli

    return run_cli("images.transfer", lambda: _send(argv),
                   "interrupted; the host keeps the partial upload and the next run resumes it.")


def _send(argv: list[str] | None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m images.transfer")
    p.add_argument("target")
    p.add_argument("file", type=Path)
    p.add_argument("remote_dir")
    p.add_argument("--port", type=int, default=22)
    p.add_argument("--identity")
    p.add_argument("--known-hosts")
    p.add_argument("--bwlimit", type=float, help="upload cap in MB/s (10**6 bytes per second)")
    p.add_argument("--force", action="store_true")
    p.add_argument("--accept-new-host-key", action="store_true",
                   help="trust and record the host's key on first contact (a changed key is still refused)")
    a = p.parse_args(argv)
    if not a.file.is_file():  # before connecting: a typo costs no SSH round trip
        raise TransferError(f"{a.file} does not exist or is not a file; give the artifact to send.")
    with SshHost(a.target, port=a.port, identity=a.identity, known_hosts=a.known_hosts,
                 accept_new_host_key=a.accept_new_host_key) as host:
        r = send_file(host, a.file, a.remote_dir, force=a.force, bwlimit_mb_s=a.bwlimit)
    print(f"{r.status} {r.remote_path} {r.bytes_sent} bytes in {r.seconds:.1f}s ({r.rate_mb_s:.1f} MB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main_send())
