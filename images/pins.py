"""The registry images a builder copies nvcc from (`[toolkits.*] kind = "image"`), pinned by digest.

targets.toml names the devel image by tag; locks/images.toml (images/pin_file.py) records its digest.
Before a build of such a target:

    pinned      the local image must carry repository@digest among its RepoDigests; if it does not, it
                is pulled by digest, and a registry that serves other bytes under that digest fails the
                pull. The build then names the image by digest, so BuildKit uses exactly those bytes.
    unpinned    (the digest was never recorded: the lock was written where the registry was unreachable)
                the image is pulled by tag and its digest recorded in locks/images.toml, which says so:
                commit the file and every later build verifies against it.

`make pin-images` pulls every such image by tag and records the digest the registry serves now.
Without a registry the pull fails at once, naming the image, why it is needed and the targets that
build without one.
"""

from __future__ import annotations

from wheelbuilder import targets as tg
from common.cmd import echo, run
from wheelbuilder.errors import FatalError, ToolchainError

from . import pin_file
from .engine import client, docker_cli, ensure_engine, image_exists


def registry_free_targets(catalog: tg.Catalog) -> list[str]:
    return sorted(t.name for t in catalog.targets.values() if t.toolkit.kind != "image")


def repo_digests(ref: str) -> list[str]:
    """The local image's RepoDigests as repository@sha256:… (Docker Hub prefixes removed)."""
    out = []
    for entry in client().images.get(ref).attrs.get("RepoDigests") or []:
        repo, _, digest = entry.partition("@")
        out.append(f"{pin_file.normalize_repository(repo)}@{digest}")
    return out


def check_repo_digests(pin: pin_file.ImagePin, digests: list[str]) -> None:
    """Refuse a local image whose RepoDigests do not hold the pinned digest."""
    want = f"{pin.repository}@{pin.digest}"
    if want not in digests:
        seen = ", ".join(digests) or "none (an image loaded from an archive carries none)"
        raise ToolchainError(
            f"the local image {pin.ref} is not the pinned one: its RepoDigests are {seen}; "
            f"locks/images.toml pins {pin.digest}. Pull the pinned bytes "
            f"with `docker pull {pin.by_digest}`; if the tag was moved on purpose, `make pin-images` and commit "
            "locks/images.toml."
        )


def _pull(ref: str, target: tg.Target, catalog: tg.Catalog) -> None:
    try:
        run([docker_cli(), "pull", ref], error=ToolchainError)
    except FatalError as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else "no output"
        raise ToolchainError(
            f"cannot pull {ref}: target {target.name} compiles with nvcc {target.toolkit.cuda} ({target.toolkit.name}), "
            f"which no PyPI wheel or Debian release carries, so the builder copies it from that image. The registry "
            f"answered: {reason}. On a machine without a registry, build a target whose nvcc comes from PyPI: "
            f"{', '.join(registry_free_targets(catalog))} (e.g. `make wheels TARGET=cu130-sm120`); build {target.name} "
            "where the registry is reachable."
        ) from None


def ensure_toolkit_image(target: tg.Target, catalog: tg.Catalog | None = None) -> str:
    """The devel image of an image-kind target, present locally and checked against its pin; returns the
    reference a build names it by (repository:tag@sha256:…). Records the digest when none is pinned yet."""
    catalog = catalog or tg.load()
    pin = pin_file.image_pin(target)
    if pin.digest:
        local = f"{pin.repository}@{pin.digest}"  # how the engine names an image by digest
        if not image_exists(local):
            echo(f"{pin.ref} is not on this engine: pulling it by its pinned digest {pin.digest}")
            _pull(pin.by_digest, target, catalog)
        check_repo_digests(pin, repo_digests(local))
        return pin.by_digest
    if not image_exists(pin.ref):
        _pull(pin.ref, target, catalog)
    digest = _registry_digest(pin)
    pin = pin_file.record_image_pin(pin.ref, digest)
    echo(f"{pin.ref} had no pinned digest: recorded {digest} (of the image on this engine) in "
         "locks/images.toml; commit it, and every later build checks against it")
    return pin.by_digest


def _registry_digest(pin: pin_file.ImagePin) -> str:
    digests = [d.partition("@")[2] for d in repo_digests(pin.ref) if d.startswith(pin.repository + "@")]
    if not digests:
        raise ToolchainError(
            f"the local image {pin.ref} carries no registry digest for {pin.repository} (loaded from an archive?), "
            "so there is nothing to pin it by. Pull it from the registry (`make pin-images` where it is reachable)."
        )
    return digests[0]


def pin_images(catalog: tg.Catalog | None = None) -> list[pin_file.ImagePin]:
    """Pull every devel image by tag and record the digest the registry serves for it now."""
    catalog = catalog or tg.load()
    ensure_engine()
    pinned = []
    for ref in pin_file.images_to_pin(catalog):
        target = next(t for t in catalog.targets.values() if t.toolkit.image == ref)
        _pull(ref, target, catalog)
        pin = pin_file.record_image_pin(ref, _registry_digest(pin_file.ImagePin(ref, None)))
        echo(f"pinned {pin.ref} to {pin.digest}")
        pinned.append(pin)
    return pinned


def register(sub) -> None:
    p = sub.add_parser("pin-images", help="pull the CUDA devel images the builders copy nvcc from and record "
                                          "their digests in locks/images.toml (needs their registry)")
    p.set_defaults(func=_cmd_pin_images)


def _cmd_pin_images(args) -> int:
    for pin in pin_images():
        print(f"{pin.ref}@{pin.digest}")
    return 0
