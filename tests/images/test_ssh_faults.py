"""SSH servers that misbehave: the upload (`python -m images.transfer`) and `push` each end, well within a
bound, in one message (exit 10, no traceback) naming the host, the port and the option or fix; what arrived
stays as .NAME.partial (never the real name), and neither a thread here nor a command on the host is left.

    a port that accepts and never greets; one that greets and then goes quiet in the key exchange
    the loopback sshd: a key it does not know; AllowUsers without the user
    the loopback sshd stopped (SIGSTOP) mid-upload: the TCP connection stays open, nothing answers
    the loopback sshd whose `sha256sum` or `pct create` never returns (a script first on the login PATH);
    one whose ForceCommand never ends (the host cannot stop that one: this side gives up)
    the loopback sshd writing to a small tmpfs that something else fills mid-upload
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from images import records, ssh, transfer
from images.errors import TransferError
from images.imageinfo import ImageInfo
from loopback import sshd
from tests.support.bad_input import assert_clear_failure
from tests.support.pct_double import DOUBLE_DIR, start_host
from tests.support.small_disk import small_disk as tmpfs

pytestmark = pytest.mark.ssh

REPO = Path(__file__).resolve().parents[2]
# Short limits, yet long enough for a loaded machine to log in and run a quick command (the pct double is a
# Python program: it starts in over a second when the machine is busy).
LIMITS = {"ssh_timeout": 3.0, "command_timeout": 8.0}
FLAGS = ["--ssh-timeout", "3", "--command-timeout", "8"]
BOUND = 45.0  # seconds any of these may take on a loaded machine; without the limits each one hung or took 15 s


@pytest.fixture(scope="module", autouse=True)
def _sshd_installed():
    why = sshd.available()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = sshd.start(tmp_path_factory.mktemp("sshd"))
    yield s
    s.stop()


def hanging_command(shims: Path, name: str, when: str = "true", otherwise: str = "false") -> Path:
    """`shims/name`: when the shell test `when` holds, records its pid in shims/pids and sleeps for ten
    minutes (a command that never returns); else runs `otherwise` with its arguments."""
    shims.mkdir(exist_ok=True)
    script = shims / name
    script.write_text(f'#!/bin/sh\nif {when}; then echo $$ >> {shims}/pids; exec sleep 600; fi\n'
                      f'exec {otherwise} "$@"\n')
    script.chmod(0o755)
    return shims / "pids"


@contextmanager
def quiet_listener(greeting: bytes):
    """A port that accepts connections, sends `greeting` and then nothing, holding them open."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    held, done = [], threading.Event()

    def serve():
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:  # the 0.2 s timeout: look at `done` again
                continue
            conn.sendall(greeting)
            held.append(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        done.set()
        thread.join(5)
        for conn in held:
            conn.close()
        listener.close()


def upload(target: str, port: int, identity, known_hosts, src: Path, dest: Path, *extra: str):
    """`python -m images.transfer` with 2 s limits: (the completed process, its seconds)."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "images.transfer", target, str(src), str(dest), "--port", str(port),
                        "--identity", str(identity), "--known-hosts", str(known_hosts), *FLAGS, *extra],
                       cwd=REPO, capture_output=True, text=True, timeout=2 * BOUND)
    return r, time.monotonic() - t0


def assert_one_message(r, seconds: float, words) -> None:
    """Exit 10 within BOUND; the last line is the one error message (progress bars may come before it)."""
    assert seconds < BOUND, f"took {seconds:.0f} s: {r.stderr}"
    assert_clear_failure(r.returncode, 10, r.stderr, words)
    assert r.stderr.count("error:") == 1 and r.stderr.rstrip().splitlines()[-1].startswith("images.transfer: error:")
    assert "Exception ignored" not in r.stderr, r.stderr


def ssh_threads() -> list[threading.Thread]:
    """paramiko's transport threads and the watchdogs that are still running."""
    import paramiko

    return [t for t in threading.enumerate() if isinstance(t, paramiko.Transport) or t.name == "ssh-watchdog"]


def wait_until(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


# -- the login -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("greeting, stage", [(b"", "sent no SSH greeting"),
                                             (b"SSH-2.0-OpenSSH_9.2\r\n", "stopped answering during the key exchange")],
                         ids=["no-greeting", "quiet-after-greeting"])
def test_a_port_that_accepts_and_goes_quiet_is_given_up_after_the_ssh_timeout(greeting, stage, server, tmp_path):
    """It was 'failed: No existing session' after paramiko's fixed 15 s, which no option changed."""
    (tmp_path / "art.tar").write_bytes(b"x")
    with quiet_listener(greeting) as port:
        r, seconds = upload("root@127.0.0.1", port, server.identity, tmp_path / "known_hosts", tmp_path / "art.tar",
                            tmp_path / "dest")
    assert_one_message(r, seconds, (f"127.0.0.1 port {port} accepted the connection but {stage}",
                                    "within --ssh-timeout 3 s", f"ssh -v -p {port} root@127.0.0.1"))
    assert not (tmp_path / "dest").exists()


def test_a_refused_key_names_the_user_the_key_and_the_fix(server, tmp_path):
    """It was 'SSH to root@127.0.0.1 port N failed: Authentication failed.'"""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "stranger")], check=True)
    (tmp_path / "art.tar").write_bytes(b"x")
    r, seconds = upload(server.target, server.port, tmp_path / "stranger", server.known_hosts, tmp_path / "art.tar",
                        tmp_path / "dest")
    assert_one_message(r, seconds, (f"127.0.0.1 port {server.port} refused the login as root with the key "
                                    f"{tmp_path / 'stranger'}", f"ssh-copy-id -i {tmp_path / 'stranger'}.pub -p "
                                    f"{server.port} root@127.0.0.1", "--identity", "AllowUsers"))
    assert not (tmp_path / "dest").exists()


def test_a_user_sshd_does_not_allow_is_named_with_allowusers(tmp_path):
    """The right key, but `AllowUsers nobody`: sshd answers as for a wrong key, so the message names both."""
    s = sshd.start(tmp_path / "sshd", config="AllowUsers nobody\n")
    try:
        (tmp_path / "art.tar").write_bytes(b"x")
        r, seconds = upload(s.target, s.port, s.identity, s.known_hosts, tmp_path / "art.tar", tmp_path / "dest")
    finally:
        s.stop()
    assert_one_message(r, seconds, (f"refused the login as root with the key {s.identity}",
                                    "may not log in at all", "AllowUsers"))


@pytest.mark.parametrize("fault", ["no-greeting", "refused-key", "forced-command"])
def test_a_failed_login_or_command_leaves_no_thread(fault, server, tmp_path):
    """In-process (as push runs it): after the error, no paramiko transport thread and no watchdog runs on."""
    before = ssh_threads()
    if fault == "forced-command":
        s = sshd.start(tmp_path / "sshd", config=f"ForceCommand echo $$ >> {tmp_path}/pids; exec sleep 600\n")
        with pytest.raises(TransferError, match="reported no exit status within --command-timeout 8 s"):
            with ssh.SshHost(s.target, port=s.port, identity=str(s.identity), known_hosts=str(s.known_hosts),
                             **LIMITS) as host:
                host.run(["true"])
        for pid in map(int, (tmp_path / "pids").read_text().split()):
            os.kill(pid, signal.SIGKILL)  # the host cannot stop a forced command; the test ends it
        s.stop()
    elif fault == "refused-key":
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")], check=True)
        with pytest.raises(TransferError, match="refused the login as root"):
            ssh.SshHost(server.target, port=server.port, identity=str(tmp_path / "k"),
                        known_hosts=str(server.known_hosts), **LIMITS)
    else:
        with quiet_listener(b"") as port, pytest.raises(TransferError, match="sent no SSH greeting"):
            ssh.SshHost("root@127.0.0.1", port=port, identity=str(server.identity),
                        known_hosts=str(server.known_hosts), **LIMITS)
    assert ssh_threads() == before


# -- mid-upload ------------------------------------------------------------------------------------------

def test_a_host_that_stalls_mid_upload_is_given_up_and_the_partial_resumes(server, tmp_path):
    """sshd's session stopped (SIGSTOP) mid-upload: the TCP connection stays open and nothing answers. It
    hung for good; now exit 10 after --ssh-timeout, the partial kept, and the next run resumes it."""
    src = tmp_path / "big.tar"
    src.write_bytes(os.urandom(24 << 20))
    dest = tmp_path / "dest"
    partial = dest / ".big.tar.partial"
    stopped: list[int] = []

    def stall():
        wait_until(lambda: partial.exists() and partial.stat().st_size > 2 << 20, "the upload never started")
        stopped.extend(server.sessions())
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)

    stopper = threading.Thread(target=stall, daemon=True)
    stopper.start()
    try:
        r, seconds = upload(server.target, server.port, server.identity, server.known_hosts, src, dest,
                            "--bwlimit", "8")
    finally:
        stopper.join(30)
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    assert stopped
    assert_one_message(r, seconds, (f"127.0.0.1 port {server.port} stopped answering while sending big.tar",
                                    "--ssh-timeout 3 s", str(partial), "resumes"))
    wait_until(lambda: not server.sessions(), "the stopped session outlived its client")
    assert sorted(p.name for p in dest.iterdir()) == [".big.tar.partial"]  # never the real name
    cut = partial.stat().st_size
    with ssh.SshHost(server.target, port=server.port, identity=str(server.identity),
                     known_hosts=str(server.known_hosts), **LIMITS) as host:
        again = transfer.send_file(host, src, str(dest), progress=False)
    assert again.status == "resumed" and again.bytes_sent == src.stat().st_size - cut
    assert (dest / "big.tar").read_bytes() == src.read_bytes()


@pytest.fixture
def small_disk(tmp_path):
    """A 96 MB tmpfs at tmp_path/disk (root only)."""
    with tmpfs(tmp_path / "disk", "96m") as disk:
        yield disk


def test_a_disk_that_fills_mid_upload_names_the_path_and_the_space_and_keeps_the_partial(server, small_disk, tmp_path):
    """Room at the check, then something else fills the filesystem. It said 'the SSH connection closed ...
    sshd restarted, the host rebooted or the network dropped' (sftp-server's bare 'Failure')."""
    src = tmp_path / "big.tar"
    src.write_bytes(os.urandom(24 << 20))
    partial = small_disk / ".big.tar.partial"

    def fill():
        wait_until(lambda: partial.exists() and partial.stat().st_size > 2 << 20, "the upload never started")
        with open(small_disk / "filler", "wb") as f:
            try:
                while True:
                    f.write(bytes(1 << 20))
            except OSError:  # ENOSPC: the filesystem is full
                pass

    filler = threading.Thread(target=fill, daemon=True)
    filler.start()
    r, seconds = upload(server.target, server.port, server.identity, server.known_hosts, src, small_disk,
                        "--bwlimit", "8")
    filler.join(30)
    assert_one_message(r, seconds, (f"127.0.0.1:{small_disk} ran out of space while receiving big.tar",
                                    "MB are free there", "more are needed", str(partial), "resumes"))
    assert sorted(p.name for p in small_disk.iterdir()) == [".big.tar.partial", "filler"]
    (small_disk / "filler").unlink()  # room again: the same command resumes from the partial
    r, _ = upload(server.target, server.port, server.identity, server.known_hosts, src, small_disk)
    assert r.returncode == 0 and "\nresumed " in r.stdout, r.stderr
    assert (small_disk / "big.tar").read_bytes() == src.read_bytes()


# -- a command on the host that never returns ------------------------------------------------------------

def test_a_checksum_that_never_returns_is_stopped_on_the_host(tmp_path):
    """`sha256sum` hangs on the host (a stuck storage mount): it hung for good, the sleep left there. Now
    exit 10 after --command-timeout, naming the command, and the host has stopped it."""
    pids = hanging_command(tmp_path / "shims", "sha256sum")
    s = sshd.start(tmp_path / "sshd", env={"PATH": f"{tmp_path / 'shims'}:{sshd.LOGIN_PATH}"})
    try:
        src = tmp_path / "art.tar"
        src.write_bytes(os.urandom(1 << 20))
        r, seconds = upload(s.target, s.port, s.identity, s.known_hosts, src, tmp_path / "dest")
        assert_one_message(r, seconds, (f"`sha256sum {tmp_path / 'dest' / '.art.tar.partial'}` did not finish on "
                                        "127.0.0.1 within --command-timeout 8 s and was stopped there",))
        assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == [".art.tar.partial"]
        hung = [int(pid) for pid in pids.read_text().split()]
        wait_until(lambda: not any(alive(pid) for pid in hung), f"the hung command {hung} still runs on the host")
    finally:
        s.stop()


# -- push ------------------------------------------------------------------------------------------------

INFO = ImageInfo(ref="dflash-train:test", id="sha256:" + "ab" * 32, tags=["dflash-train:test"], labels={},
                 env=["PATH=/usr/bin:/bin"], entrypoint=["/bin/sh"], cmd=[], workdir="/", user="")


@pytest.fixture
def pve(tmp_path, monkeypatch):
    """A loopback 'Proxmox host' (the pct doubles) whose `pct create` never returns, and an exported
    artifact of INFO in dist/ (the local engine's inspect is replaced: no Docker here)."""
    monkeypatch.setattr("images.push.inspect_image", lambda ref: INFO)
    dist = tmp_path / "dist"
    dist.mkdir()
    artifact = dist / f"{INFO.slug}.tar.zst"
    artifact.write_bytes(os.urandom(1 << 20))
    records.write_record(artifact, INFO, "template")
    pids = hanging_command(tmp_path / "shims", "pct", when='[ "$1" = create ]', otherwise=str(DOUBLE_DIR / "pct"))
    env = {"PATH": f"{tmp_path / 'shims'}:{DOUBLE_DIR}:{sshd.LOGIN_PATH}", "PCT_DOUBLE_PYTHON": sys.executable,
           "PYTHONPATH": str(REPO), "PCT_DOUBLE_ROOT": str(tmp_path / "lxc"), "PCT_DOUBLE_CONF_DIR": str(tmp_path / "conf"),
           "PCT_DOUBLE_TEMPLATE_DIR": str(tmp_path / "cache")}
    (tmp_path / "lxc").mkdir()
    host = start_host(tmp_path / "sshd", env)
    yield host, dist, pids
    host.stop()


def push(host, dist: Path, port: int, identity, capsys) -> tuple[int, str, float]:
    from images.__main__ import main

    t0 = time.monotonic()
    rc = main(["push", "--host", "root@127.0.0.1", "--port", str(port), "--identity", str(identity), "--known-hosts",
               str(host.known_hosts), "--ctid", "300", "--image", INFO.ref, "--out-dir", str(dist), "--gpus", "none",
               "--rootfs-size", "1", "--pve-config-dir", str(dist.parent / "conf"), *FLAGS])
    return rc, capsys.readouterr().err, time.monotonic() - t0


def test_push_whose_pct_create_never_returns_stops_it_on_the_host(pve, capsys):
    """It hung for good after `+ ssh ... pct create`; now exit 10 naming the command and the option."""
    host, dist, pids = pve
    before = ssh_threads()
    rc, err, seconds = push(host, dist, host.port, host.identity, capsys)
    assert seconds < BOUND
    assert_clear_failure(rc, 10, err, ("`pct create 300 local:vztmpl/", "did not finish on 127.0.0.1 within "
                                       "--command-timeout 8 s and was stopped there"))
    assert err.count("error:") == 1 and err.rstrip().splitlines()[-1].startswith("images: error:")
    hung = [int(pid) for pid in pids.read_text().split()]
    wait_until(lambda: not any(alive(pid) for pid in hung), f"`pct create` {hung} still runs on the host")
    assert ssh_threads() == before


def test_push_to_a_quiet_port_or_with_a_refused_key_says_so_before_anything_else(pve, tmp_path, capsys):
    """The same login messages as the upload's, from `push`, each the only line it prints."""
    host, dist, _ = pve
    with quiet_listener(b"") as port:
        rc, err, seconds = push(host, dist, port, host.identity, capsys)
    assert seconds < BOUND
    assert_clear_failure(rc, 10, err, (f"127.0.0.1 port {port} accepted the connection but sent no SSH greeting "
                                       "within --ssh-timeout 3 s",))
    assert err.count("\n") == 1, err
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "stranger")], check=True)
    rc, err, _ = push(host, dist, host.port, tmp_path / "stranger", capsys)
    assert_clear_failure(rc, 10, err, (f"refused the login as root with the key {tmp_path / 'stranger'}", "ssh-copy-id"))
    assert err.count("\n") == 1, err
