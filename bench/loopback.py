"""What the transfer benchmarks (bench_push.py, bench_publish.py) start on this machine to measure against,
all on 127.0.0.1 and all thrown away afterwards:

    start_sshd(workdir, env)     OpenSSH's sshd on a free port, throwaway host and user keys, SFTP; `env`
                                 becomes SetEnv lines of every login (DOCKER_HOST of a second engine)
    start_registry(workdir)      Debian's docker-registry with TLS (a CA made here) and htpasswd auth
    start_engine(root)           a second, empty dockerd (no bridge, its own data root and containerd
                                 namespace) on ROOT/docker.sock: "the GPU box" an image travels to
    demo_image(), labelled_demo_image(tag)
                                 a small image with dflash-train's shape (venv on PATH, ENV, WORKDIR,
                                 ENTRYPOINT), FROM dflash-base:bookworm when the engine has it, else from
                                 a busybox rootfs imported on the spot; the labelled one adds the runtime
                                 image's labels, an SBOM (images.sbom) and an entrypoint that answers `doctor`

The benchmarks run as scripts (`python bench/bench_push.py`), so this directory is first on sys.path and
they import this module as `loopback`. Needs root for sshd and dockerd, Debian's docker-registry for the
registry, and the cryptography and bcrypt packages (the dev lock) for its certificate and password.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import ipaddress
import os
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REGISTRY_BINARY = "/usr/bin/docker-registry"
DEMO_TAG = "dflash-bench-demo:latest"
BUSYBOX_TAG = "dflash-bench-busybox:1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, log: Path, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f} s: {log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()


# ---- sshd -------------------------------------------------------------------------------------------
@dataclass
class LoopbackSshd:
    port: int
    target: str  # root@127.0.0.1
    identity: Path  # private user key
    known_hosts: Path  # holds the server's host key
    proc: subprocess.Popen

    def stop(self) -> None:
        _stop(self.proc)


def start_sshd(workdir: Path, env: dict[str, str] | None = None) -> LoopbackSshd:
    """sshd on a free loopback port, accepting only a user key generated here; `env` is set for every login."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(workdir / name)], check=True)
    (workdir / "authorized_keys").write_text((workdir / "user_key.pub").read_text())
    os.chmod(workdir / "authorized_keys", 0o600)
    Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation directory sshd insists on
    port = _free_port()
    login_env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", **(env or {})}
    setenv = " ".join(f'"{k}={v}"' for k, v in login_env.items())
    (workdir / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {workdir}/host_key\n"
        f"AuthorizedKeysFile {workdir}/authorized_keys\nPidFile {workdir}/sshd.pid\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "UsePAM no\nStrictModes no\nSubsystem sftp internal-sftp\n"
        f"SetEnv {setenv}\n"
    )
    host_pub = (workdir / "host_key.pub").read_text().split()
    (workdir / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
    log = workdir / "sshd.log"
    proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(workdir / "sshd_config")],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    _wait_listening(port, proc, log, "sshd", 10)
    return LoopbackSshd(port, "root@127.0.0.1", workdir / "user_key", workdir / "known_hosts", proc)


# ---- registry ---------------------------------------------------------------------------------------
@dataclass
class LoopbackRegistry:
    host: str  # 127.0.0.1:PORT
    ca: Path  # PEM of the CA that signed the server certificate
    user: str
    password: str
    log: Path
    proc: subprocess.Popen

    def stop(self) -> None:
        _stop(self.proc)

    def uploads(self) -> int:
        """Blob uploads the registry has started so far (POST .../blobs/uploads/ in its access log)."""
        return sum('"POST /v2/' in line and "/blobs/uploads/" in line for line in self.log.read_text().splitlines())


def _make_ca(workdir: Path) -> tuple[Path, Path, Path]:
    """(ca.crt, server.crt, server.key): a CA and a certificate for 127.0.0.1 signed by it, valid two days."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(subject, key, signer, ca: bool, san=None):
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dflash bench CA")]))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("dflash bench CA", ca_key, ca_key, True)
    server = cert("127.0.0.1", key, ca_key, False,
                  [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    paths = workdir / "ca.crt", workdir / "server.crt", workdir / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def start_registry(workdir: Path, user: str = "dflash", password: str | None = None) -> LoopbackRegistry:
    """docker-registry on a free loopback port: TLS from a CA made here, one htpasswd (bcrypt) user."""
    import secrets

    import bcrypt

    if not Path(REGISTRY_BINARY).exists():
        raise RuntimeError("Debian's docker-registry is not installed (apt install docker-registry)")
    password = password or secrets.token_urlsafe(16)
    workdir.mkdir(parents=True, exist_ok=True)
    _, crt, key = _make_ca(workdir)
    (workdir / "htpasswd").write_text(f"{user}:{bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=5)).decode()}\n")
    port = _free_port()
    (workdir / "config.yml").write_text(
        "version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: false\n"
        f"storage:\n  filesystem:\n    rootdirectory: {workdir / 'data'}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n  tls:\n    certificate: {crt}\n    key: {key}\n"
        f"auth:\n  htpasswd:\n    realm: dflash-bench\n    path: {workdir / 'htpasswd'}\n")
    log = workdir / "registry.log"
    proc = subprocess.Popen([REGISTRY_BINARY, "serve", str(workdir / "config.yml")], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT)
    _wait_listening(port, proc, log, "docker-registry", 15)
    return LoopbackRegistry(f"127.0.0.1:{port}", workdir / "ca.crt", user, password, log, proc)


def remove_engine_trust(host: str) -> None:
    """Forget the CA `publish` installed for this registry in the engine's trust (/etc/docker/certs.d)."""
    shutil.rmtree(Path("/etc/docker/certs.d") / host, ignore_errors=True)


# ---- a second engine --------------------------------------------------------------------------------
def start_engine(root: Path) -> tuple[subprocess.Popen, str]:
    """(process, DOCKER_HOST) of a second dockerd listening on ROOT/docker.sock (keep ROOT short: a unix
    socket path holds at most 108 bytes)."""
    sock = root / "docker.sock"
    log = root / "dockerd.log"
    proc = subprocess.Popen(
        ["dockerd", "--bridge=none", "--iptables=false", "--ip6tables=false", f"--data-root={root / 'data'}",
         f"--exec-root={root / 'exec'}", f"--pidfile={root / 'dockerd.pid'}", f"--host=unix://{sock}",
         "--containerd-namespace=dflash-bench", "--containerd-plugins-namespace=dflash-bench-plugins"],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if subprocess.run(["docker", "-H", f"unix://{sock}", "version"], capture_output=True).returncode == 0:
            return proc, f"unix://{sock}"
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the second dockerd did not start: {log.read_text()[-1500:]}")


# ---- a small image ----------------------------------------------------------------------------------
DOCKERFILE = """FROM {base}
RUN mkdir -p /opt/venv/bin /workspace \\
 && printf '#!/bin/sh\\necho "demo-train VIRTUAL_ENV=$VIRTUAL_ENV PWD=$(pwd) ARGS=$*"\\n' > /opt/venv/bin/dflash-train \\
 && printf '#!/bin/sh\\necho "doctor: all checks passed VIRTUAL_ENV=$VIRTUAL_ENV PWD=$(pwd) ARGS=$*"\\n' > /opt/venv/bin/dflash \\
 && chmod +x /opt/venv/bin/dflash-train /opt/venv/bin/dflash \\
 && ln /opt/venv/bin/dflash /opt/venv/bin/dflash-hardlink
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LD_LIBRARY_PATH=/opt/venv/lib
WORKDIR /workspace
LABEL io.dflash.target=cu130-sm120
ENTRYPOINT ["dflash-train"]
"""

LABELLED_DOCKERFILE = """FROM {demo}
COPY sbom.cdx.json /opt/dflash/sbom.cdx.json
RUN printf '{revision}\\n' > /opt/dflash/revision \\
 && printf '#!/bin/sh\\nif [ "$1" = doctor ]; then echo "doctor: all checks passed ARGS=$*"; exit 0; fi\\nexec dflash-train "$@"\\n' > /usr/local/bin/dflash-entry \\
 && chmod +x /usr/local/bin/dflash-entry
ENTRYPOINT ["dflash-entry"]
LABEL org.opencontainers.image.title=dflash-train org.opencontainers.image.revision={revision} \\
      io.dflash.target=cu130-sm120 io.dflash.torch-lock=cu130 io.dflash.wheel-sha256={wheel} \\
      io.dflash.sbom=/opt/dflash/sbom.cdx.json
"""


def _build(tag: str, dockerfile: str, files: dict[str, Path] | None = None) -> str:
    from images.engine import docker_cli

    with tempfile.TemporaryDirectory() as ctx:
        Path(ctx, "Dockerfile").write_text(dockerfile)
        for name, path in (files or {}).items():
            shutil.copy(path, Path(ctx, name))
        subprocess.run([docker_cli(), "build", "--network=host", "-q", "-t", tag, ctx], check=True,
                       capture_output=True, env={**os.environ, "DOCKER_BUILDKIT": "1"})
    return tag


def _busybox_base() -> str:
    """A busybox rootfs (busybox-static from the host) imported as BUSYBOX_TAG."""
    busybox = shutil.which("busybox")
    if not busybox:
        raise RuntimeError("neither dflash-base:bookworm (make base) nor busybox (apt install busybox-static) is available")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "tmp", "proc", "sys", "dev", "root"):
            ti = tarfile.TarInfo(d)
            ti.type, ti.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(ti)
        tar.add(busybox, "bin/busybox")
        applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
        for applet in applets:
            if applet != "busybox":
                ti = tarfile.TarInfo(f"bin/{applet}")
                ti.type, ti.linkname = tarfile.SYMTYPE, "busybox"
                tar.addfile(ti)
        for name, text in (("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"), ("etc/group", "root:x:0:\n"),
                           ("etc/os-release", "ID=busybox\nNAME=busybox\n")):
            ti = tarfile.TarInfo(name)
            ti.size = len(text)
            tar.addfile(ti, io.BytesIO(text.encode()))
    subprocess.run(["docker", "import", "-", BUSYBOX_TAG], input=buf.getvalue(), check=True, capture_output=True)
    return BUSYBOX_TAG


def demo_image() -> str:
    """DEMO_TAG, built (or found in the build cache) FROM dflash-base:bookworm, else a busybox rootfs."""
    import docker

    names = {t for img in docker.from_env().images.list() for t in img.tags}
    base = "dflash-base:bookworm" if "dflash-base:bookworm" in names else (
        BUSYBOX_TAG if BUSYBOX_TAG in names else _busybox_base())
    return _build(DEMO_TAG, DOCKERFILE.format(base=base))


def labelled_demo_image(tag: str, revision: str = "0123456789abcdef0123") -> str:
    """The demo image with the runtime image's labels, an SBOM of locks/cu130 (images.sbom) and an
    entrypoint whose `doctor` passes: what `publish` and `push-docker` need, in seconds."""
    from images import sbom

    demo = demo_image()
    with tempfile.TemporaryDirectory() as tmp:
        sbom_file = Path(tmp, "sbom.cdx.json")
        sbom.main(["--locks", str(REPO / "locks" / "cu130"), "--out", str(sbom_file)])
        wheel = hashlib.sha256(revision.encode()).hexdigest()
        return _build(tag, LABELLED_DOCKERFILE.format(demo=demo, revision=revision, wheel=wheel),
                      {"sbom.cdx.json": sbom_file})
