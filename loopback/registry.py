"""A real OCI registry on 127.0.0.1: Debian's docker-registry (the distribution v2 server) with TLS from a
CA made here and one htpasswd (bcrypt) user."""

from __future__ import annotations

import datetime
import ipaddress
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from loopback.net import free_port, stop, wait_listening

BINARY = "/usr/bin/docker-registry"


@dataclass
class LoopbackRegistry:
    host: str  # 127.0.0.1:PORT
    ca: Path  # PEM of the CA that signed the server certificate
    user: str
    password: str
    log: Path
    proc: subprocess.Popen

    def stop(self) -> None:
        stop(self.proc)

    def uploads(self) -> int:
        """Blob uploads the registry has started so far (POST .../blobs/uploads/ in its access log)."""
        return sum('"POST /v2/' in line and "/blobs/uploads/" in line for line in self.log.read_text().splitlines())


def available() -> str | None:
    """None when a loopback registry can run here, else why not."""
    if not Path(BINARY).exists():
        return "Debian's docker-registry is not installed (apt install docker-registry)"
    return None


def make_ca(workdir: Path) -> tuple[Path, Path, Path]:
    """(ca.crt, server.crt, server.key) in `workdir`: a CA and a certificate for 127.0.0.1 (and localhost)
    signed by it, valid two days."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    issuer = "dflash loopback CA"

    def cert(subject, key, signer, ca: bool, san=None):
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert(issuer, ca_key, ca_key, True)
    server = cert("127.0.0.1", key, ca_key, False,
                  [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    paths = workdir / "ca.crt", workdir / "server.crt", workdir / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def start(workdir: Path, user: str = "dflash", password: str | None = None) -> LoopbackRegistry:
    """docker-registry on a free loopback port: TLS from a CA made in `workdir`, one htpasswd (bcrypt) user
    (`password` defaults to a random one)."""
    import bcrypt

    why = available()
    if why:
        raise RuntimeError(why)
    password = password or secrets.token_urlsafe(16)
    workdir.mkdir(parents=True, exist_ok=True)
    ca, crt, key = make_ca(workdir)
    (workdir / "htpasswd").write_text(f"{user}:{bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=5)).decode()}\n")
    port = free_port()
    (workdir / "config.yml").write_text(
        "version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: false\n"
        f"storage:\n  filesystem:\n    rootdirectory: {workdir / 'data'}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n  tls:\n    certificate: {crt}\n    key: {key}\n"
        f"auth:\n  htpasswd:\n    realm: dflash-loopback\n    path: {workdir / 'htpasswd'}\n")
    log = workdir / "registry.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([BINARY, "serve", str(workdir / "config.yml")], stdout=out, stderr=subprocess.STDOUT)
    wait_listening(port, proc, log, "docker-registry", 15)
    return LoopbackRegistry(f"127.0.0.1:{port}", ca, user, password, log, proc)


def remove_engine_trust(host: str) -> None:
    """Forget the CA `publish` installed for this registry in the engine's trust (/etc/docker/certs.d)."""
    shutil.rmtree(Path("/etc/docker/certs.d") / host, ignore_errors=True)
