"""An OCI registry as `publish` and `push --from-registry` see it: references, credentials, trust, and the
few calls of the distribution API the engine does not make for us (spec: github.com/opencontainers/
distribution-spec, v1.1).

    reference    REGISTRY=host[:port]/namespace[/...]; a host needs a '.', a ':' or is 'localhost' (as in
                 Docker's reference grammar), and a namespace is required: `ghcr.io` alone is refused
    credentials  DFLASH_REGISTRY_USER + DFLASH_REGISTRY_PASSWORD, else the Docker config
                 ($DOCKER_CONFIG/config.json or ~/.docker/config.json: credHelpers, credsStore, auths);
                 they travel in request headers only, never on a command line or into a layer
    trust        --ca-cert FILE, else the engine's /etc/docker/certs.d/HOST[:PORT]/ca.crt, else the system CAs
    calls        GET /v2/ (reachable? credentials?), manifests by tag, blobs (HEAD before any upload, so
                 nothing is sent twice), PUT manifest, the referrers API with its tag-schema fallback
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from .errors import RegistryError

DOCKER_CERTS_D = Path("/etc/docker/certs.d")
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
EMPTY_CONFIG = {"mediaType": "application/vnd.oci.empty.v1+json", "size": 2,
                "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"}  # b"{}"
ACCEPT = ", ".join((OCI_MANIFEST, DOCKER_MANIFEST, OCI_INDEX, DOCKER_LIST))
_HOST = re.compile(r"^(localhost|[A-Za-z0-9.-]+\.[A-Za-z0-9.-]+|[A-Za-z0-9.-]+:\d+|\[[0-9a-fA-F:]+\](:\d+)?)(:\d+)?$")
_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG = re.compile(r"^\w[\w.-]{0,127}$")


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Reference:
    """host[:port] / repository path [:tag | @digest]."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    def __str__(self) -> str:
        return f"{self.registry}/{self.repository}" + (f":{self.tag}" if self.tag else "") + (
            f"@{self.digest}" if self.digest else "")

    @property
    def name(self) -> str:
        return f"{self.registry}/{self.repository}"


def _split_host(text: str, what: str, example: str) -> tuple[str, str]:
    if "://" in text:
        raise RegistryError(f"{what} '{text}' has a scheme; give it without one (always HTTPS), e.g. {example}.")
    host, _, rest = text.partition("/")
    if not _HOST.match(host):
        raise RegistryError(f"{what} '{text}' does not start with a registry host (a name with a '.' or a ':PORT', "
                            f"or localhost); e.g. {example}.")
    return host, rest


def parse_registry(text: str, image_name: str = "dflash-train") -> Reference:
    """REGISTRY=host[:port]/namespace -> the repository host/namespace/<image_name> (no tag)."""
    example = "ghcr.io/myorg or registry.example.com:5000/team"
    host, namespace = _split_host(text.strip().rstrip("/"), "REGISTRY", example)
    if not namespace:
        raise RegistryError(f"REGISTRY '{text}' has no namespace: give host[:port]/namespace, e.g. {example}/ "
                            "(the image is pushed as <namespace>/dflash-train).")
    parts = namespace.split("/")
    bad = [p for p in parts if not _COMPONENT.match(p)]
    if bad or ":" in namespace or "@" in namespace:
        raise RegistryError(f"REGISTRY '{text}': namespace '{namespace}' is not a repository path (lowercase "
                            "letters, digits and . _ - between them; no tag or digest); e.g. " + example + ".")
    return Reference(host, f"{namespace}/{image_name}")


def parse_reference(text: str) -> Reference:
    """host[:port]/namespace/name:tag (or @sha256:...) as `docker pull` takes it, with an explicit host."""
    example = "registry.example.com:5000/team/dflash-train:cu130-sm120"
    host, rest = _split_host(text.strip(), "reference", example)
    digest = None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
    path, tag = rest, None
    if ":" in rest.rsplit("/", 1)[-1]:
        path, tag = rest.rsplit(":", 1)
    parts = path.split("/")
    if len(parts) < 2 or not all(_COMPONENT.match(p) for p in parts):
        raise RegistryError(f"reference '{text}' needs a namespace and a name after the host "
                            f"(host[:port]/namespace/name:tag), e.g. {example}.")
    if tag is not None and not _TAG.match(tag):
        raise RegistryError(f"reference '{text}': '{tag}' is not a valid tag.")
    if tag is None and digest is None:
        raise RegistryError(f"reference '{text}' has no tag; give one (e.g. :cu130-sm120) rather than an implicit "
                            "'latest'.")
    return Reference(host, path, tag, digest)


# ------------------------------------------------------------------------------------------------------
# credentials and trust
# ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)
    source: str  # where they came from, for messages (never the secret itself)


def docker_config_path() -> Path:
    return Path(os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker") / "config.json"


def credentials(registry: str) -> Credentials | None:
    """The credentials for `registry`: environment first, then the Docker config (see the module docstring)."""
    user, password = os.environ.get("DFLASH_REGISTRY_USER"), os.environ.get("DFLASH_REGISTRY_PASSWORD")
    if user and password:
        return Credentials(user, password, "DFLASH_REGISTRY_USER/DFLASH_REGISTRY_PASSWORD")
    path = docker_config_path()
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise RegistryError(f"cannot read the Docker config {path}: {e}. Fix or remove it.") from None
    helper = (cfg.get("credHelpers") or {}).get(registry) or cfg.get("credsStore")
    if helper:
        found = _from_helper(helper, registry)
        if found:
            return found
    for key in (registry, f"https://{registry}", f"https://{registry}/v1/", f"http://{registry}"):
        entry = (cfg.get("auths") or {}).get(key) or {}
        if entry.get("auth"):
            user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
            return Credentials(user, password, f"{path} (auths.{key})")
    return None


def _from_helper(helper: str, registry: str) -> Credentials | None:
    exe = shutil.which(f"docker-credential-{helper}")
    if not exe:
        raise RegistryError(f"the Docker config names the credential helper '{helper}' but docker-credential-{helper} "
                            "is not on PATH. Install it, or set DFLASH_REGISTRY_USER and DFLASH_REGISTRY_PASSWORD.")
    out = subprocess.run([exe, "get"], input=registry, capture_output=True, text=True)
    if out.returncode != 0:
        return None  # the helper holds nothing for this registry
    data = json.loads(out.stdout)
    return Credentials(data.get("Username", ""), data.get("Secret", ""), f"docker-credential-{helper}")


def trusted_ca(registry: str, ca_cert: str | None) -> str | bool:
    """What TLS verification trusts for `registry` (a CA file or True for the system CAs)."""
    if ca_cert:
        if not Path(ca_cert).is_file():
            raise RegistryError(f"--ca-cert {ca_cert} does not exist; give the PEM file of the registry's CA.")
        return str(ca_cert)
    engine_ca = DOCKER_CERTS_D / registry / "ca.crt"
    if engine_ca.is_file():
        return str(engine_ca)
    from .engine import ca_bundle

    return ca_bundle() or True


# ------------------------------------------------------------------------------------------------------
# the distribution API
# ------------------------------------------------------------------------------------------------------

@dataclass
class Manifest:
    digest: str
    media_type: str
    body: bytes

    @property
    def json(self) -> dict:
        return json.loads(self.body)

    @property
    def config_digest(self) -> str | None:
        """The image's config digest (= the engine's image ID); None for an index."""
        return (self.json.get("config") or {}).get("digest")

    def descriptor(self) -> dict:
        return {"mediaType": self.media_type, "digest": self.digest, "size": len(self.body)}


class Registry:
    """One registry host, with credentials and a CA; counts the bytes it uploads."""

    def __init__(self, registry: str, creds: Credentials | None = None, verify: str | bool = True,
                 timeout: float = 30.0):
        import requests

        self.host = registry
        self.creds = creds
        self.timeout = timeout
        self.session = requests.Session()
        self.session.verify = verify
        self.bytes_sent = 0
        self.blobs_sent = 0

    # -- transport ------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, *, retry_auth: bool = True, **kw):
        import requests

        url = f"https://{self.host}/v2/{path}"
        try:
            # verify per request: a session-level value loses to $REQUESTS_CA_BUNDLE (psf/requests#3829)
            r = self.session.request(method, url, timeout=self.timeout, verify=self.session.verify, **kw)
        except requests.exceptions.SSLError as e:
            raise RegistryError(
                f"TLS to {self.host} failed: its certificate is not signed by a CA this machine trusts ({_short(e)}). "
                f"Pass --ca-cert FILE with the registry's CA (it is also installed for the engine in "
                f"{DOCKER_CERTS_D}/{self.host}/ca.crt), or put that file there yourself.") from None
        except requests.exceptions.ConnectionError as e:
            raise RegistryError(
                f"cannot reach the registry https://{self.host}/v2/ ({_short(e)}). Check the host and port in "
                "REGISTRY, that the registry runs and that this machine can reach it.") from None
        except requests.exceptions.Timeout:
            raise RegistryError(f"the registry {self.host} did not answer within {self.timeout:.0f} s.") from None
        if r.status_code == 401 and retry_auth and self._authenticate(r):
            return self._request(method, path, retry_auth=False, **kw)
        if r.status_code == 401:
            raise self._refused()
        if r.status_code == 403:
            raise RegistryError(f"{self.host} refused {method} {path} (403 Forbidden) for "
                                f"{self.creds.username if self.creds else 'anonymous'}: the account lacks push/pull "
                                "rights on this repository. Use an account that has them.")
        return r

    def _refused(self) -> RegistryError:
        if self.creds is None:
            return RegistryError(
                f"{self.host} asks for credentials and none were found (neither DFLASH_REGISTRY_USER/"
                f"DFLASH_REGISTRY_PASSWORD nor an entry in {docker_config_path()}). Run `docker login {self.host}` "
                "(--password-stdin keeps the password off the command line) or set those two variables.")
        return RegistryError(
            f"{self.host} refused the credentials of '{self.creds.username}' from {self.creds.source} "
            f"(401 Unauthorized). Fix the password there, e.g. `docker login {self.host} --username "
            f"{self.creds.username} --password-stdin`.")

    def _authenticate(self, r) -> bool:
        """Answer a 401 challenge: Basic (htpasswd registries) or a Bearer token from the realm."""
        challenge = r.headers.get("WWW-Authenticate", "")
        scheme = challenge.split(" ", 1)[0].lower()
        if self.creds is None and scheme != "bearer":
            return False
        if scheme == "basic":
            if self.session.auth is not None:
                return False
            self.session.auth = (self.creds.username, self.creds.password)
            return True
        if scheme == "bearer":
            params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
            auth = (self.creds.username, self.creds.password) if self.creds else None
            import requests

            try:
                t = requests.get(params["realm"], params={k: v for k, v in params.items() if k in ("service", "scope")},
                                 auth=auth, verify=self.session.verify, timeout=self.timeout)
            except (KeyError, requests.exceptions.RequestException):
                return False
            if t.status_code != 200:
                return False
            token = t.json().get("token") or t.json().get("access_token")
            self.session.auth = None
            self.session.headers["Authorization"] = f"Bearer {token}"
            return True
        return False

    def _check(self, r, what: str):
        if r.status_code >= 300:
            raise RegistryError(f"{self.host}: {what} failed with HTTP {r.status_code}: {r.text.strip()[:400]}")
        return r

    # -- calls ----------------------------------------------------------------------------------------
    def ping(self) -> None:
        """GET /v2/: reachable, trusted, and (with the credentials) willing; raises RegistryError otherwise."""
        r = self._request("GET", "")
        self._check(r, "GET /v2/ (is this an OCI registry?)")

    def manifest(self, repository: str, ref: str) -> Manifest | None:
        r = self._request("GET", f"{repository}/manifests/{ref}", headers={"Accept": ACCEPT})
        if r.status_code == 404:
            return None
        self._check(r, f"GET manifest {repository}:{ref}")
        return Manifest(r.headers.get("Docker-Content-Digest") or digest_of(r.content),
                        r.headers.get("Content-Type", "").split(";")[0], r.content)

    def blob(self, repository: str, digest: str) -> bytes:
        return self._check(self._request("GET", f"{repository}/blobs/{digest}"), f"GET blob {digest}").content

    def has_blob(self, repository: str, digest: str) -> bool:
        return self._request("HEAD", f"{repository}/blobs/{digest}").status_code == 200

    def upload_blob(self, repository: str, data: bytes) -> str:
        """Monolithic upload (POST then PUT ?digest=), skipped when the registry already has the blob."""
        digest = digest_of(data)
        if self.has_blob(repository, digest):
            return digest
        r = self._check(self._request("POST", f"{repository}/blobs/uploads/"), "starting a blob upload")
        location = r.headers["Location"]
        sep = "&" if "?" in location else "?"
        url = location if location.startswith("http") else f"https://{self.host}{location}"
        put = self.session.put(f"{url}{sep}digest={digest}", data=data, timeout=self.timeout, verify=self.session.verify,
                               headers={"Content-Type": "application/octet-stream"})
        self._check(put, f"uploading blob {digest}")
        self.bytes_sent += len(data)
        self.blobs_sent += 1
        return digest

    def put_manifest(self, repository: str, ref: str, body: bytes, media_type: str) -> str:
        r = self._request("PUT", f"{repository}/manifests/{ref}", data=body, headers={"Content-Type": media_type})
        self._check(r, f"PUT manifest {repository}:{ref}")
        self.bytes_sent += len(body)
        return r.headers.get("Docker-Content-Digest") or digest_of(body)

    def attach_referrer(self, repository: str, subject: str, descriptor: dict) -> str:
        """Make `descriptor` (a manifest with `subject`) discoverable from `subject`: through the referrers
        API where the registry has it (it indexes on PUT), else the spec's referrers tag schema
        (`sha256-<hex>` tagging an index of the referrers). Returns how: "api" or the fallback tag."""
        r = self._request("GET", f"{repository}/referrers/{subject}", headers={"Accept": OCI_INDEX})
        if r.status_code == 200 and r.headers.get("Content-Type", "").startswith(OCI_INDEX):
            return "api"
        tag = subject.replace(":", "-")
        current = self.manifest(repository, tag)
        index = current.json if current and current.media_type == OCI_INDEX else {
            "schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": []}
        if not any(m.get("digest") == descriptor["digest"] for m in index["manifests"]):
            index["manifests"].append(descriptor)
            self.put_manifest(repository, tag, json.dumps(index, sort_keys=True).encode(), OCI_INDEX)
        return tag


def _short(e: Exception) -> str:
    text = str(e)
    m = re.search(r"(certificate verify failed[^')\"]*|Connection refused|Name or service not known|"
                  r"No route to host|timed out|Temporary failure in name resolution)", text)
    return m.group(1) if m else text[-200:]
