"""Send an artifact to a host over SSH: resumable, checksummed on the host, renamed into place atomically.

The connection, its limits in time and its failures are images/ssh.py's; this is the upload protocol.
On the host, for a file NAME in DIR:

    DIR/.NAME.partial   grows while sending; kept when the client dies, the connection drops or stalls, or
                        the host's disk fills, so the next run appends to it (after checking that its bytes
                        are a prefix of the local file)
    DIR/NAME            appears only by `rename(.NAME.partial, NAME)` after `sha256sum` on the host
                        matched: a half-written or corrupt file never carries the real name
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from common.fsutil import sha256_file

from . import ssh
from .errors import TransferError
from .ssh import SshHost
from .watchdog import Watchdog

CHUNK = 1 << 20
SPACE_MARGIN = 64 << 20  # keep this much free on the host after the upload


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
    def stat(sftp) -> int | None:
        try:
            return sftp.stat(path).st_size
        except FileNotFoundError:
            return None

    return host.sftp_request(f"reading the size of {path}", stat)


def remote_free_bytes(host: SshHost, directory: str) -> int:
    out = host.run(["df", "-P", "-B1", directory]).stdout.splitlines()
    return int(out[-1].split()[3])


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def send_file(host: SshHost, local: Path, remote_dir: str, *, sha256: str | None = None,
              force: bool = False, bwlimit_mb_s: float | None = None, progress: bool = True) -> TransferResult:
    """Upload `local` to `remote_dir/<name>`; see the module docstring for the protocol.

    `sha256`: the digest the file must have (from its export record); computed when None.
    `bwlimit_mb_s`: upload cap in MB/s (10**6 bytes per second). Raises TransferError before sending anything
    when the name is taken by a different file (without `force`) or the host lacks space."""
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
    with host.talking(f"sending {local.name} to {remote_dir}", after=_resumes(partial)):
        host.run(["mkdir", "-p", remote_dir])
        if _already_there(host, local, final, digest, force):
            return TransferResult(final, "already-present", 0, time.monotonic() - start, digest)
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
            host.sftp_request(f"removing {partial}", lambda sftp: sftp.remove(partial))
            raise TransferError(
                f"checksum mismatch after upload: {host.hostname}:{partial} has sha256 {theirs}, expected "
                f"{digest}. The partial was deleted and nothing was renamed; check the local file "
                f"({local}) against its record and run again."
            )
        # atomic on one filesystem, replaces an old file (--force)
        host.sftp_request(f"renaming {partial} to {final}", lambda sftp: sftp.posix_rename(partial, final))
        return TransferResult(final, "resumed" if offset else "sent", size - offset,
                              time.monotonic() - start, digest)


def _resumes(partial: str) -> str:
    return f"The host keeps what arrived in {partial}: run the same command again and the upload resumes from there."


def _already_there(host: SshHost, local: Path, final: str, digest: str, force: bool) -> bool:
    """True when `final` holds this very file; a different file there is refused unless `force`."""
    existing = remote_size(host, final)
    if existing is None:
        return False
    theirs = remote_sha256(host, final)
    if theirs == digest:
        return True
    if not force:
        raise TransferError(
            f"{host.hostname}:{final} already exists with different content (sha256 {theirs[:16]}..., "
            f"{existing} bytes; ours {digest[:16]}..., {local.stat().st_size} bytes). Pass --force to replace it, "
            "or give the new artifact another name."
        )
    return False


def _upload(host: SshHost, local: Path, partial: str, offset: int, size: int,
            bwlimit_mb_s: float | None, progress: bool) -> None:
    """Append local[offset:] to the remote partial, pipelined, with tqdm rate and ETA. The host may stay
    silent for --ssh-timeout between two writes it takes (its window stays shut while it stalls)."""
    t0 = time.monotonic()
    sent = 0
    dst = refused = None

    def stalled() -> str:
        return host.stopped_answering(f"sending {local.name} ({_size(offset + sent)} of {_size(size)} sent)",
                                      after=_resumes(partial))

    with host.watching(host.ssh_timeout, stalled) as dog:
        try:
            dst = host.sftp.open(partial, "ab" if offset else "wb")
            with open(local, "rb") as src, tqdm(total=size, initial=offset, unit="B", unit_scale=True, unit_divisor=1024,
                                                desc=f"send {local.name}", disable=not progress) as bar:
                dst.set_pipelined(True)
                src.seek(offset)
                while block := src.read(CHUNK):
                    dst.write(block)
                    dog.progress()
                    sent += len(block)
                    bar.update(len(block))
                    if bwlimit_mb_s:
                        _pace(sent / (bwlimit_mb_s * 1e6), t0, dog)
            dst.close()  # waits until the host has acknowledged every pipelined write
        except OSError as e:
            if dog.fired or not host.connected:
                host.abort()
                raise
            if dst is not None:  # the host answered, with a refusal (its disk is full?): the connection stays usable
                _drain(dst)
            refused = e
        except BaseException:
            # Interrupted (Ctrl-C, SIGTERM) or failed mid-write: the connection may hold half a request, and
            # closing the file politely would wait for acknowledgements that never come (or fail and hide the
            # interruption). Drop the connection: the host's SFTP server ends, keeping what it has written.
            host.abort()
            raise
    if refused is not None:
        raise _write_refused(host, local, partial, size, refused)


def _pace(due: float, t0: float, dog: Watchdog) -> None:
    """Sleep until `due` seconds after `t0` (the --bwlimit cap). Waiting here is no silence of the host."""
    while (ahead := due - (time.monotonic() - t0)) > 0:
        time.sleep(min(ahead, 1.0))
        dog.progress()


def _drain(dst) -> None:
    """Close a pipelined SFTP file after the host refused a write. Each close() reads the replies still due
    and raises at the next refusal among them; once all are read it closes the handle, and the SFTP session
    can serve the requests that say what happened."""
    for _ in range(100_000):  # more than the writes one upload can have in flight
        try:
            dst.close()
            return
        except OSError:
            continue


def _write_refused(host: SshHost, local: Path, partial: str, size: int, error: OSError) -> TransferError:
    """The host refused a write mid-upload. OpenSSH's sftp-server answers a full disk with a bare 'Failure'
    (SSH_FX_FAILURE: it maps only a few errno values), so the free space there tells what it was."""
    directory = partial.rsplit("/", 1)[0] or "/"
    free = remote_free_bytes(host, directory)
    arrived = remote_size(host, partial) or 0
    keep = (f"The host keeps what arrived in {partial}: run the same command again once there is room and the "
            "upload resumes from there (or delete it and choose another storage).")
    if free < size - arrived:
        return TransferError(
            f"{host.hostname}:{directory} ran out of space while receiving {local.name}: {_size(arrived)} of "
            f"{_size(size)} arrived, {_size(free)} are free there and {_size(size - arrived)} more are needed "
            f"(the space was there when the upload began: something else wrote there meanwhile). Free space there (df -h {directory}). {keep}")
    return TransferError(f"{host.hostname}:{directory} refused a write to {partial} ({error or type(error).__name__}) "
                         f"with {_size(free)} free there (a quota, a read-only or failing disk?). {keep}")


def main_send(argv: list[str] | None = None) -> int:
    """`python -m images.transfer HOST FILE DIR [...]`: one upload (used by tests to kill a client).
    Errors print their message and exit with their code (images/errors.py): 10 transfer (refused, stalled,
    timed out, a full disk), 11 host key;
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
    ssh.add_timeout_arguments(p)
    a = p.parse_args(argv)
    if not a.file.is_file():  # before connecting: a typo costs no SSH round trip
        raise TransferError(f"{a.file} does not exist or is not a file; give the artifact to send.")
    with SshHost(a.target, port=a.port, identity=a.identity, known_hosts=a.known_hosts,
                 accept_new_host_key=a.accept_new_host_key, ssh_timeout=a.ssh_timeout,
                 command_timeout=a.command_timeout) as host:
        r = send_file(host, a.file, a.remote_dir, force=a.force, bwlimit_mb_s=a.bwlimit)
    print(f"{r.status} {r.remote_path} {r.bytes_sent} bytes in {r.seconds:.1f}s ({r.rate_mb_s:.1f} MB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main_send())
