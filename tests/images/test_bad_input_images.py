"""Bad input and faults for the images program: `python -m images.transfer` (the upload, against a real
OpenSSH server on loopback where one is installed) and the rootfs template's repack. Each case runs the
real command line and asserts the exit code (images/errors.py: 10 transfer, 11 host key; 130 Ctrl-C,
143 SIGTERM), the key words of the message, no traceback, and that the destination holds nothing new
(only the resumable .NAME.partial after an interrupted upload, by design).
"""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

import pytest

from tests.support.bad_input import assert_clear_failure, snapshot
from images import imageinfo, template
from images.transfer import main_send
from common.fsutil import sha256_file
from loopback.net import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from loopback import sshd

    why = sshd.available()
    if why:
        pytest.skip(why)
    s = sshd.start(tmp_path_factory.mktemp("sshd"))
    yield s
    s.stop()


NOT_SSH: dict[str, int] = {}  # the port of the `not_ssh` listener, while it runs


@pytest.fixture(scope="module")
def not_ssh():
    """A loopback port where something other than sshd answers: a web server's greeting, then it hangs
    up (what --port reaches when it names the wrong service). Serves until the module's tests are done."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    done = threading.Event()

    def serve():
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:  # the 0.2 s timeout: look at `done` again
                continue
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    NOT_SSH["port"] = listener.getsockname()[1]
    yield NOT_SSH["port"]
    done.set()
    thread.join(5)
    listener.close()
    NOT_SSH.clear()


def other_key(tmp: Path, server) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "other")], check=True)
    kind, key = (tmp / "other.pub").read_text().split()[:2]
    wrong = tmp / "wrong_known_hosts"
    wrong.write_text(f"[127.0.0.1]:{server.port} {kind} {key}\n")
    return wrong


@dataclass
class Case:
    id: str
    argv: Callable[[Path, object], list[str]]  # (tmp, server) -> arguments
    code: int
    words: tuple[str, ...]
    needs_server: bool = True


def send(file: str = "art.tar", *, known: Callable[[Path, object], Path] | None = None, target: str | None = None,
         port: Callable[[object], int] | None = None, extra: tuple[str, ...] = ()):
    def argv(t: Path, s) -> list[str]:
        return [target or s.target, str(t / file), str(t / "dest"), "--port", str(port(s) if port else s.port),
                "--identity", str(s.identity), "--known-hosts", str(known(t, s) if known else s.known_hosts), *extra]
    return argv


def empty_known(t: Path, s) -> Path:
    (t / "empty_known_hosts").write_text("")
    return t / "empty_known_hosts"


CASES = [
    Case("unknown-host-key", send(known=empty_known), 11, ("is not in", "--accept-new-host-key")),
    Case("changed-host-key", send(known=other_key), 11, ("does not match", "ssh-keygen -R")),
    Case("changed-host-key-accept-new", send(known=other_key, extra=("--accept-new-host-key",)), 11,
         ("does not match",)),
    Case("connection-refused", send(port=lambda s: free_port()), 10, ("cannot connect", "Is sshd running")),
    Case("port-is-not-ssh", send(port=lambda s: NOT_SSH["port"]), 10,
         ("answered, but not as an SSH server", "protocol banner", "Check --port")),
    Case("port-in-host", send(target="root@127.0.0.1:2223"), 2, ("--host root@127.0.0.1 --port 2223",)),
    Case("port-in-ipv6-host", send(target="root@[::1]:2223"), 2, ("--host root@::1 --port 2223",)),
    Case("missing-file", send("nope.tar"), 10, ("nope.tar does not exist",)),
    Case("no-host", send(target="root@"), 10, ("names no host", "USER@HOST")),
    Case("bad-identity", lambda t, s: send(extra=("--identity", str(t / "no_key")))(t, s), 10, ("no_key",)),
    Case("remote-dir-under-a-file", lambda t, s: [*send()(t, s)[:2], str(t / "art.tar" / "sub"), *send()(t, s)[3:]],
         10, ("mkdir",)),
]


@pytest.mark.ssh
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_transfer_bad_input(case: Case, server, not_ssh, tmp_path, capsys):
    (tmp_path / "art.tar").write_bytes(os.urandom(1 << 16))
    argv = case.argv(tmp_path, server)
    before = snapshot(tmp_path)
    code = main_send(argv)
    err = capsys.readouterr().err
    assert_clear_failure(code, case.code, err, case.words)
    assert snapshot(tmp_path) - before == set()


@pytest.mark.ssh
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_mid_upload_exits_with_its_code_and_keeps_only_the_partial(sig, code, server, tmp_path):
    src = tmp_path / "big.tar"
    src.write_bytes(os.urandom(16 << 20))
    dest = tmp_path / "dest"
    partial = dest / ".big.tar.partial"
    proc = subprocess.Popen([sys.executable, "-m", "images.transfer", server.target, str(src), str(dest),
                             "--port", str(server.port), "--identity", str(server.identity),
                             "--known-hosts", str(server.known_hosts), "--bwlimit", "4"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (partial.exists() and partial.stat().st_size > 1 << 20):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    assert "resumes" in err and "Traceback" not in err
    assert sorted(p.name for p in dest.iterdir()) == [".big.tar.partial"]  # never the real name


@pytest.mark.ssh
def test_a_connection_dropped_mid_upload_exits_10_and_keeps_the_partial(server, tmp_path):
    """sshd's session dies mid-upload (sshd restarted, the host rebooted): exit 10 with a message that says
    so and that the next run resumes; no traceback (was paramiko's OSError 'Socket is closed')."""
    src = tmp_path / "big.tar"
    src.write_bytes(os.urandom(16 << 20))
    dest = tmp_path / "dest"
    partial = dest / ".big.tar.partial"
    proc = subprocess.Popen([sys.executable, "-m", "images.transfer", server.target, str(src), str(dest),
                             "--port", str(server.port), "--identity", str(server.identity),
                             "--known-hosts", str(server.known_hosts), "--bwlimit", "4"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (partial.exists() and partial.stat().st_size > 1 << 20):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        assert server.drop_connections()
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_clear_failure(proc.returncode, 10, err, ("closed while sending big.tar", "resumes", str(partial)))
    assert sorted(p.name for p in dest.iterdir()) == [".big.tar.partial"]  # never the real name


PUSH_CASES = [  # `python -m images push`: (id, --host, --ctid, exit code, words), each refused before connecting
    ("ctid-negative", "root@127.0.0.1", "-5", 2, ("CTID -5 is out of range", "100 to 999999999")),
    ("ctid-reserved", "root@127.0.0.1", "99", 2, ("CTID 99 is out of range", "reserved")),
    ("ctid-too-large", "root@127.0.0.1", str(10**9), 2, (f"CTID {10**9} is out of range",)),
    ("ctid-not-a-number", "root@127.0.0.1", "two", 2, ("CTID 'two' is not a whole number",)),
    ("port-in-host", "root@pve.invalid:2223", "200", 2, ("--host root@pve.invalid --port 2223",)),
]


@pytest.mark.parametrize("host, ctid, code, words", [c[1:] for c in PUSH_CASES], ids=[c[0] for c in PUSH_CASES])
def test_push_bad_options_are_refused_before_connecting(host, ctid, code, words, tmp_path, capsys):
    """Nothing answers on the port given and the image does not exist: only a refusal that comes before
    the image is read and the host is reached gives these exit codes and words."""
    from images.__main__ import main

    before = snapshot(tmp_path)
    try:
        rc = main(["push", "--host", host, "--port", str(free_port()), "--ctid", ctid, "--image",
                   "dflash-no-such-image:1", "--out-dir", str(tmp_path / "dist")])
    except SystemExit as e:  # argparse refuses a malformed option value itself, with exit 2
        rc = e.code
    assert_clear_failure(rc, code, capsys.readouterr().err, words)
    assert snapshot(tmp_path) == before


def _run(*argv: str) -> subprocess.CompletedProcess:
    """A command of the images program in a process of its own: paramiko's log (the tracebacks this guards
    against) goes to the real stderr there, not to pytest's log capture."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", *argv], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_upload_to_a_port_where_no_ssh_server_answers(not_ssh, tmp_path):
    (tmp_path / "art.tar").write_bytes(b"x")
    r = _run("images.transfer", "root@127.0.0.1", str(tmp_path / "art.tar"), str(tmp_path / "dest"),
             "--port", str(not_ssh), "--known-hosts", str(tmp_path / "known_hosts"))
    assert_clear_failure(r.returncode, 10, r.stderr, (f"port {not_ssh} answered, but not as an SSH server",))
    assert r.stderr.count("\n") == 1, f"one message, nothing before it: {r.stderr}"
    assert not (tmp_path / "dest").exists()


@pytest.mark.docker
def test_push_to_a_port_where_no_ssh_server_answers(not_ssh, tmp_path):
    """`python -m images push` to a port where a web server answers: one message, exit 10, and none of
    paramiko's tracebacks before it."""
    from tests.support.demo_image import demo_image_or_skip

    image = demo_image_or_skip()
    r = _run("images", "push", "--host", "root@127.0.0.1", "--port", str(not_ssh), "--ctid", "200", "--image",
             image, "--known-hosts", str(tmp_path / "known_hosts"), "--out-dir", str(tmp_path / "dist"))
    assert_clear_failure(r.returncode, 10, r.stderr, (f"port {not_ssh} answered, but not as an SSH server",
                                                      "Check --port"))
    assert r.stderr.count("\n") == 1, f"one message, nothing before it: {r.stderr}"
    assert not (tmp_path / "dist").exists()


def test_an_export_into_a_directory_in_use_is_refused(tmp_path, capsys):
    """Another export holds the output directory: refused (7) before the image is even looked up."""
    from common.fsutil import exclusive
    from images.__main__ import main

    out = tmp_path / "dist"
    with exclusive(out, "export"):
        before = snapshot(tmp_path)
        rc = main(["export", "--image", "dflash-no-such-image:1", "--format", "template", "--out-dir", str(out)])
        assert_clear_failure(rc, 7, capsys.readouterr().err, ("another export is using", f"pid {os.getpid()}"))
        assert snapshot(tmp_path) == before


@pytest.mark.docker
def test_two_exports_into_one_directory_are_refused_or_serialised(tmp_path):
    """Two real `export` processes started together into one --out-dir: the second is refused (7) while the
    first holds the directory, or runs after it; never both at once (they would share .NAME.tmp)."""
    from images import records
    from tests.support.demo_image import demo_image_or_skip

    image = demo_image_or_skip()
    out = tmp_path / "dist"
    cmd = [sys.executable, "-m", "images", "export", "--image", image, "--format", "template", "--out-dir", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=300), p.communicate()[1]) for p in procs]
    codes = sorted(rc for rc, _ in results)
    assert codes in ([0, 0], [0, 7]), results
    for rc, err in results:
        assert "Traceback" not in err, err
        if rc == 7:
            assert "another export is using" in err, err
    artifacts = [p for p in out.iterdir() if p.name.endswith(".tar.zst")]
    assert len(artifacts) == 1
    record = records.read_record(artifacts[0])
    assert record["size"] == artifacts[0].stat().st_size and record["sha256"] == sha256_file(artifacts[0])
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".build.lock"]


def _spool(tmp: Path, names: dict[str, bytes | None]) -> Path:
    spool = tmp / "export.tar"
    with tarfile.open(spool, "w") as tar:
        for name, data in names.items():
            ti = tarfile.TarInfo(name)
            if data is None:
                ti.type = tarfile.DIRTYPE
                tar.addfile(ti)
            else:
                ti.size = len(data)
                tar.addfile(ti, io.BytesIO(data))
    return spool


def _info():
    return imageinfo.ImageInfo(ref="demo:1", id="sha256:" + "ab" * 32, tags=["demo:1"], labels={}, workdir="/",
                               user="", env=["PATH=/usr/bin:/bin"], entrypoint=["/bin/sh"], cmd=[])


def test_the_template_carries_no_build_leftovers(tmp_path):
    """/tmp's contents (torch's inductor cache) and an emptied /wheels/ stay out of the rootfs."""
    spool = _spool(tmp_path, {"./bin/sh": b"#!", "./tmp": None, "./tmp/torchinductor_root": None,
                              "./tmp/torchinductor_root/cache.bin": b"x", "./wheels": None, "./opt/keep": None,
                              "./opt/keep/file": b"y"})
    dest = tmp_path / "t.tar"
    template._repack(spool, dest, _info(), 0, ["sh", "-c", f"cat > {dest}"], progress=False)
    with tarfile.open(dest) as tar:
        names = set(tar.getnames())
    assert "./tmp" in names and "./bin/sh" in names and "./opt/keep/file" in names
    assert not [n for n in names if n.startswith("./tmp/") or n == "./wheels"]


def test_a_failed_repack_leaves_no_template(tmp_path, monkeypatch):
    """A compressor that dies (a full disk) is an ExportError (9) and leaves no half-written file."""
    from images.errors import ExportError

    spool = _spool(tmp_path, {"./bin/sh": b"#!"})
    dest = tmp_path / "t.tar.zst"
    with pytest.raises(ExportError, match="full disk"):
        template._repack(spool, dest, _info(), 0, ["sh", "-c", f"head -c 10 > {dest}; exit 1"], progress=False)
    assert not dest.exists()
    assert ExportError.exit_code == 9
