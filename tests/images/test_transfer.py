"""Uploads against a real OpenSSH server on loopback: resume, checksums, atomic rename, host keys."""

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from images import ssh, transfer
from images.errors import HostKeyError, TransferError
from loopback import sshd

pytestmark = pytest.mark.ssh

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    why = sshd.available()
    if why:
        pytest.skip(why)
    s = sshd.start(tmp_path_factory.mktemp("sshd"))
    yield s
    s.stop()


def connect(server, **kw):
    return ssh.SshHost(server.target, port=server.port, identity=str(server.identity),
                            known_hosts=str(server.known_hosts), **kw)


def random_file(path: Path, size: int) -> Path:
    path.write_bytes(os.urandom(size))
    return path


def test_send_verifies_and_renames_then_skips_identical(server, tmp_path):
    src = random_file(tmp_path / "art.tar", 3 << 20)
    dest = tmp_path / "cache"
    with connect(server) as host:
        r = transfer.send_file(host, src, str(dest), progress=False)
        assert r.status == "sent" and r.bytes_sent == src.stat().st_size
        assert (dest / "art.tar").read_bytes() == src.read_bytes()
        assert not (dest / ".art.tar.partial").exists()
        again = transfer.send_file(host, src, str(dest), progress=False)
        assert again.status == "already-present" and again.bytes_sent == 0


def test_different_file_with_same_name_needs_force(server, tmp_path):
    dest = tmp_path / "cache"
    dest.mkdir()
    (dest / "art.tar").write_bytes(b"an older template")
    src = random_file(tmp_path / "art.tar", 1 << 20)
    with connect(server) as host:
        with pytest.raises(TransferError, match="already exists with different content.*--force"):
            transfer.send_file(host, src, str(dest), progress=False)
        assert (dest / "art.tar").read_bytes() == b"an older template"
        r = transfer.send_file(host, src, str(dest), force=True, progress=False)
        assert r.status == "sent" and (dest / "art.tar").read_bytes() == src.read_bytes()


def test_checksum_mismatch_never_takes_the_real_name(server, tmp_path):
    src = random_file(tmp_path / "art.tar", 1 << 20)
    dest = tmp_path / "cache"
    recorded = hashlib.sha256(b"what the export record says").hexdigest()
    with connect(server) as host:
        with pytest.raises(TransferError, match="checksum mismatch.*nothing was renamed"):
            transfer.send_file(host, src, str(dest), sha256=recorded, progress=False)
    assert not (dest / "art.tar").exists() and not (dest / ".art.tar.partial").exists()


def sessions_of(server) -> list[int]:
    """Pids of the per-connection processes the loopback sshd has forked (they serve internal-sftp)."""
    return server.sessions()


def wait_for_sessions_to_end(server, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sessions_of(server):
        assert time.monotonic() < deadline, f"sshd sessions {sessions_of(server)} outlived their client"
        time.sleep(0.05)


def test_killed_client_resumes_from_the_partial(server, tmp_path):
    size = 24 << 20
    src = random_file(tmp_path / "big.tar", size)
    dest = tmp_path / "cache"
    partial = dest / ".big.tar.partial"
    cmd = [sys.executable, "-m", "images.transfer", server.target, str(src), str(dest),
           "--port", str(server.port), "--identity", str(server.identity),
           "--known-hosts", str(server.known_hosts), "--bwlimit", "8"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (partial.exists() and partial.stat().st_size > 4 << 20):
        assert proc.poll() is None, "the upload finished before it could be interrupted"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # The host's sftp session still writes the requests already in flight after the client dies; the
    # partial is what the next run resumes from once that session has ended.
    wait_for_sessions_to_end(server)
    cut = partial.stat().st_size
    assert 0 < cut < size
    assert not (dest / "big.tar").exists()  # the real name only ever holds a verified file

    with connect(server) as host:
        r = transfer.send_file(host, src, str(dest), progress=False)
    assert r.status == "resumed" and r.bytes_sent == size - cut
    assert (dest / "big.tar").read_bytes() == src.read_bytes()


def test_partial_of_another_file_is_restarted(server, tmp_path):
    src = random_file(tmp_path / "art.tar", 2 << 20)
    dest = tmp_path / "cache"
    dest.mkdir()
    (dest / ".art.tar.partial").write_bytes(os.urandom(1 << 20))  # a different version's leftovers
    with connect(server) as host:
        r = transfer.send_file(host, src, str(dest), progress=False)
    assert r.status == "sent" and (dest / "art.tar").read_bytes() == src.read_bytes()


def test_not_enough_space_is_refused_before_sending(server, tmp_path):
    src = tmp_path / "huge.tar"
    with open(src, "wb") as f:  # sparse: claims far more than the disk holds
        f.truncate(1 << 43)  # 8 TiB
    with connect(server) as host:
        with pytest.raises(TransferError, match="GB free but the upload needs"):
            transfer.send_file(host, src, str(tmp_path / "cache"), sha256="0" * 64, progress=False)
    assert not (tmp_path / "cache" / ".huge.tar.partial").exists()


def test_unknown_host_key_is_refused_unless_accepted(server, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(HostKeyError, match="not in .*--accept-new-host-key"):
        ssh.SshHost(server.target, port=server.port, identity=str(server.identity), known_hosts=str(empty))
    with ssh.SshHost(server.target, port=server.port, identity=str(server.identity),
                          known_hosts=str(empty), accept_new_host_key=True) as host:
        assert host.run(["true"]).rc == 0
    assert f"[127.0.0.1]:{server.port}" in empty.read_text()


def test_changed_host_key_is_refused_even_with_accept_new(server, tmp_path):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    kind, key = (tmp_path / "other.pub").read_text().split()[:2]
    wrong = tmp_path / "known_hosts"
    wrong.write_text(f"[127.0.0.1]:{server.port} {kind} {key}\n")
    with pytest.raises(HostKeyError, match="does not match"):
        ssh.SshHost(server.target, port=server.port, identity=str(server.identity),
                         known_hosts=str(wrong), accept_new_host_key=True)


def test_a_connection_dropped_mid_command_is_a_transfer_error(server):
    """The channel closes mid-read (sshd's session killed): a TransferError saying so, also where the
    caller only wanted the exit status (check=False), never a made-up exit code of -1."""
    for check in (True, False):
        with connect(server) as host:
            timer = threading.Timer(1.0, server.drop_connections)
            timer.start()
            try:
                with pytest.raises(TransferError, match=r"closed while `echo started; sleep 30` ran.*It had "
                                                        r"printed: started.*Run the command again"):
                    host.run("echo started; sleep 30", check=check)
            finally:
                timer.cancel()
            with pytest.raises(TransferError, match="closed while running `true`"):
                host.run("true")  # and the next command on the dead connection says the same
    wait_for_sessions_to_end(server)
