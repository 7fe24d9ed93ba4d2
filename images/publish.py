"""`publish`: push dflash-train:<target> to any OCI registry, with its SBOM attached.

    check   the image is in the engine; REGISTRY has a namespace; the registry answers over TLS we trust
            and takes the credentials; no tag already points to another image (unless --force)
            (every refusal before anything is pushed)
    push    through the engine (it compresses each layer once, HEADs every blob first and sends only the
            missing ones: "Layer already exists"), with a progress bar and the bytes per layer counted
    tags    <target>, <target>-<revision[:12]>, <target>-wheel-<wheel sha256[:12]>: one manifest
    sbom    /opt/dflash/sbom.cdx.json out of the image, pushed as an OCI 1.1 artifact (artifactType
            application/vnd.cyclonedx+json) whose `subject` is the image: found through the referrers API
            or its `sha256-<hex>` fallback tag, and by the tag <target>.sbom
    print   the digest and the `docker pull` / `docker run --gpus all` lines

Credentials: DFLASH_REGISTRY_USER/DFLASH_REGISTRY_PASSWORD or the Docker config (images/registry.py); they
reach the engine as the push's auth header, never as an argument. Provenance: the image's own labels
(org.opencontainers.image.revision, io.dflash.*) travel in its config; the SBOM artifact carries them as
OCI annotations too.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from . import registry as reg
from .errors import ExportError, RegistryError
from .imageinfo import TARGET_LABEL, ImageInfo, inspect_image

SBOM_LABEL = "io.dflash.sbom"
REVISION_LABEL = "org.opencontainers.image.revision"
WHEEL_LABEL = "io.dflash.wheel-sha256"


@dataclass
class PublishOptions:
    image: str  # local engine reference, dflash-train:<target>
    registry: str  # host[:port]/namespace
    ca_cert: str | None = None
    force: bool = False
    progress: bool = True
    dry_run: bool = False


@dataclass
class PublishReport:
    repository: str
    tags: list[str]
    digest: str = ""
    layers_pushed: int = 0
    layers_existing: int = 0
    bytes_pushed: int = 0  # layer bytes the engine pushed, as its progress counts them (uncompressed tar)
    image_bytes: int = 0  # the image in the registry: compressed layers + config (the manifest's sizes)
    seconds: float = 0.0
    sbom: dict = field(default_factory=dict)

    @property
    def pull(self) -> str:
        return f"{self.repository}@{self.digest}"


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def tags_for(info: ImageInfo) -> list[str]:
    """<target>, <target>-<revision[:12]> and <target>-wheel-<sha256[:12]> (the last two when known)."""
    target = info.labels.get(TARGET_LABEL) or (info.tags[0] if info.tags else info.ref).rsplit(":", 1)[-1]
    tags = [target]
    rev = info.labels.get(REVISION_LABEL, "unknown")
    if rev and rev != "unknown":
        tags.append(f"{target}-{rev[:12]}")
    wheel = info.labels.get(WHEEL_LABEL, "unknown")
    if wheel and wheel != "unknown":
        tags.append(f"{target}-wheel-{wheel[:12]}")
    return tags


def _image(ref: str) -> ImageInfo:
    try:
        return inspect_image(ref)
    except ExportError:
        target = ref.rsplit(":", 1)[-1]
        raise ExportError(f"image '{ref}' is not in the local engine, so there is nothing to publish. Build it "
                          f"first: make image TARGET={target}") from None


def check_tags(client: reg.Registry, repo: str, tags: list[str], image_id: str, force: bool) -> None:
    """Refuse a tag that already names another image (its config digest is not our image ID)."""
    for tag in tags:
        remote = client.manifest(repo, tag)
        if remote is None or remote.config_digest == image_id:
            continue
        theirs = remote.config_digest or f"an index ({remote.media_type})"
        if not force:
            raise RegistryError(
                f"{client.host}/{repo}:{tag} already points to another image ({theirs[:19]}, manifest "
                f"{remote.digest[:19]}); this one is {image_id[:19]}. Pass --force to move the tag, or publish "
                "to another namespace.")
        say(f"--force: moving {tag} from {theirs[:19]} to {image_id[:19]}")


def engine_trust(registry: str, ca_cert: str | None) -> None:
    """The engine checks the registry's certificate itself: install --ca-cert where it looks for it."""
    if not ca_cert:
        return
    dest = reg.DOCKER_CERTS_D / registry / "ca.crt"
    data = Path(ca_cert).read_bytes()
    if dest.is_file() and dest.read_bytes() == data:
        return
    if os.environ.get("DOCKER_HOST", "unix://").split("://")[0] not in ("unix", ""):
        raise RegistryError(f"the engine is remote ({os.environ['DOCKER_HOST']}): copy {ca_cert} to "
                            f"{dest} on its machine so that it trusts {registry}, then run again.")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
    except OSError as e:
        raise RegistryError(f"cannot install the CA for the engine at {dest} ({e.strerror}). As root: "
                            f"install -D -m 644 {ca_cert} {dest}  (no engine restart needed), then run again.") from None
    say(f"installed {ca_cert} as {dest} (the engine's trust for {registry})")


def engine_push(name: str, tag: str, creds: reg.Credentials | None, report: PublishReport, progress: bool) -> str:
    """`docker push name:tag` through the engine API; returns the manifest digest."""
    from .engine import client

    api = client().api
    auth = {"username": creds.username, "password": creds.password} if creds else None
    layers: dict[str, list[int]] = {}  # id -> [current, total]
    digest = ""
    with tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024, desc=f"push {tag}", disable=not progress,
              leave=False) as bar:
        for ev in api.push(name, tag=tag, stream=True, decode=True, auth_config=auth):
            if "error" in ev:
                raise _push_error(name, ev.get("errorDetail", {}).get("message") or ev["error"])
            status, lid = ev.get("status", ""), ev.get("id")
            if status == "Pushing" and lid and ev.get("progressDetail", {}).get("total"):
                cur = layers.setdefault(lid, [0, 0])
                cur[0], cur[1] = ev["progressDetail"]["current"], ev["progressDetail"]["total"]
                bar.total = sum(t for _, t in layers.values())
                bar.n = sum(min(c, t) for c, t in layers.values())
                bar.refresh()
            elif status == "Pushed":
                report.layers_pushed += 1
                report.bytes_pushed += layers.get(lid, [0, 0])[0]
                if progress:
                    tqdm.write(f"  {lid}: pushed {layers.get(lid, [0, 0])[0] / 1e6:.1f} MB", file=sys.stderr)
            elif status == "Layer already exists" or status.startswith("Mounted from"):
                report.layers_existing += 1
            if ev.get("aux", {}).get("Digest"):
                digest = ev["aux"]["Digest"]
    if not digest:
        raise RegistryError(f"the engine pushed {name}:{tag} but reported no digest; see `docker push` output.")
    return digest


def _push_error(name: str, message: str) -> RegistryError:
    host = name.split("/", 1)[0]
    if "x509" in message or "certificate" in message:
        return RegistryError(f"the engine does not trust {host}'s certificate ({message}). Pass --ca-cert FILE "
                             f"(installed as {reg.DOCKER_CERTS_D}/{host}/ca.crt).")
    if "unauthorized" in message or "authentication required" in message:
        return RegistryError(f"{host} refused the engine's push: {message}. Check the credentials "
                             "(docker login, or DFLASH_REGISTRY_USER/PASSWORD).")
    return RegistryError(f"pushing {name} failed: {message}")


def read_sbom(info: ImageInfo) -> bytes | None:
    """The SBOM file the image's label points to, read from a created (never started) container."""
    path = info.labels.get(SBOM_LABEL)
    if not path:
        return None
    from .engine import client

    c = client().containers.create(info.id, entrypoint=["/nonexistent"], network_disabled=True)
    try:
        stream, _ = c.get_archive(path)
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            return tar.extractfile(tar.getmembers()[0]).read()
    finally:
        c.remove(force=True)


def push_sbom(client: reg.Registry, repo: str, info: ImageInfo, image: reg.Manifest, sbom: bytes,
              sbom_tag: str) -> dict:
    """The SBOM as an OCI 1.1 artifact manifest with `subject` = the image; tagged and indexed as referrer."""
    from .sbom import MEDIA_TYPE

    layer = {"mediaType": MEDIA_TYPE, "digest": client.upload_blob(repo, sbom), "size": len(sbom),
             "annotations": {"org.opencontainers.image.title": "sbom.cdx.json"}}
    client.upload_blob(repo, b"{}")
    notes = {"org.opencontainers.image.created": _created(info), "org.opencontainers.image.title": "dflash-train SBOM"}
    for label in (REVISION_LABEL, TARGET_LABEL, WHEEL_LABEL, "io.dflash.torch-lock"):
        if info.labels.get(label):
            notes[label] = info.labels[label]
    manifest = {"schemaVersion": 2, "mediaType": reg.OCI_MANIFEST, "artifactType": MEDIA_TYPE,
                "config": reg.EMPTY_CONFIG, "layers": [layer], "subject": image.descriptor(), "annotations": notes}
    body = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    digest = client.put_manifest(repo, sbom_tag, body, reg.OCI_MANIFEST)
    how = client.attach_referrer(repo, image.digest, {"mediaType": reg.OCI_MANIFEST, "digest": digest,
                                                      "size": len(body), "artifactType": MEDIA_TYPE,
                                                      "annotations": notes})
    return {"digest": digest, "tag": sbom_tag, "referrers": how, "bytes": len(sbom)}


def _created(info: ImageInfo) -> str:
    from .engine import client

    return client().images.get(info.id).attrs.get("Created", "")[:19] + "Z"


def publish(o: PublishOptions) -> PublishReport:
    ref = reg.parse_registry(o.registry)
    info = _image(o.image)
    tags = tags_for(info)
    creds = reg.credentials(ref.registry)
    client = reg.Registry(ref.registry, creds, reg.trusted_ca(ref.registry, o.ca_cert))
    client.ping()
    check_tags(client, ref.repository, tags, info.id, o.force)
    report = PublishReport(ref.name, tags)
    say(f"publishing {o.image} ({info.id[:19]}) to {ref.name} as {', '.join(tags)}")
    if o.dry_run:
        return report
    engine_trust(ref.registry, o.ca_cert)
    from .engine import client as engine

    img = engine().images.get(info.id)
    t0 = time.monotonic()
    digests = set()
    for i, tag in enumerate(tags):
        img.tag(ref.name, tag)
        # Layer counts from the first tag's push; the others only add a manifest to the same layers.
        counts = report if i == 0 else PublishReport(ref.name, [tag])
        digests.add(engine_push(ref.name, tag, creds, counts, o.progress))
    for tag in tags:  # the registry names were only needed to push; the engine keeps the image as it was
        engine().images.remove(f"{ref.name}:{tag}", noprune=True)
    if len(digests) != 1:
        raise RegistryError(f"the tags of one image got different digests ({', '.join(sorted(digests))}); "
                            "the registry rewrote a manifest. Inspect it with `skopeo inspect`.")
    report.digest = digests.pop()
    report.seconds = time.monotonic() - t0
    image = client.manifest(ref.repository, report.digest)
    report.image_bytes = sum(x["size"] for x in image.json.get("layers", [])) + image.json["config"]["size"]
    sbom = read_sbom(info)
    if sbom is None:
        say(f"{o.image} has no {SBOM_LABEL} label (built before the SBOM step): nothing attached")
    else:
        report.sbom = push_sbom(client, ref.repository, info, image, sbom, f"{tags[0]}.sbom")
    return report


def summary(report: PublishReport) -> str:
    lines = [f"pushed {report.repository}:{report.tags[0]} in {report.seconds:.1f} s: {report.layers_pushed} layer(s) "
             f"sent ({report.bytes_pushed / 1e6:.1f} MB before compression), {report.layers_existing} already there; "
             f"{report.image_bytes / 1e6:.1f} MB in the registry",
             f"digest: {report.digest}"]
    if report.sbom:
        lines.append(f"sbom:   {report.repository}:{report.sbom['tag']} ({report.sbom['digest'][:19]}, referrer of "
                     f"the image via {report.sbom['referrers']})")
    lines += ["", f"  docker pull {report.pull}",
              f"  docker run --gpus all --rm {report.pull} doctor",
              f"  docker run --gpus all -it -v $PWD/data:/data {report.repository}:{report.tags[0]} train --help"]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------------

def _cmd_publish(args: argparse.Namespace) -> int:
    from .export import image_from_args

    report = publish(PublishOptions(image=image_from_args(args), registry=args.registry, ca_cert=args.ca_cert,
                                    force=args.force, progress=not args.json, dry_run=args.dry_run))
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    elif not args.dry_run:
        print(summary(report))
    return 0


def register(subparsers) -> None:
    from .export import add_image_arguments

    p = subparsers.add_parser("publish", help="push dflash-train:<target> and its SBOM to an OCI registry",
                              formatter_class=argparse.RawDescriptionHelpFormatter, description=__doc__)
    p.add_argument("--registry", required=True, help="host[:port]/namespace, e.g. ghcr.io/myorg")
    add_image_arguments(p)
    p.add_argument("--ca-cert", help="PEM file of the registry's CA (also installed for the engine in "
                                     "/etc/docker/certs.d/HOST/ca.crt); default: the system's CAs")
    p.add_argument("--force", action="store_true", help="move tags that point to another image")
    p.add_argument("--dry-run", action="store_true", help="run every check, print the tags, push nothing")
    p.add_argument("--json", action="store_true", help="print the report as JSON (no progress bar)")
    p.set_defaults(func=_cmd_publish)
