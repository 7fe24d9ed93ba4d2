"""What an image's config says, as a container made from it on a Proxmox host needs it.

`inspect_image` reads the config through the engine API: Env, Entrypoint, Cmd, WorkingDir and User
(which `docker export` drops and the rootfs template carries as files), the labels, and the CUDA
runtime the image's torch uses (which the host driver must support).
"""

from __future__ import annotations

from dataclasses import dataclass

from wheelbuilder.errors import FatalError

from .errors import ExportError

TARGET_LABEL = "io.dflash.target"  # set by the Dockerfile; targets.toml knows its torch's CUDA


@dataclass(frozen=True)
class ImageInfo:
    """What an image's config says, as the container on the host needs it."""

    ref: str
    id: str
    tags: list[str]
    labels: dict[str, str]
    env: list[str]  # KEY=VALUE, as in the image config
    entrypoint: list[str]
    cmd: list[str]
    workdir: str
    user: str
    cuda: str | None = None

    @property
    def slug(self) -> str:
        """File-name stem: repository name and the id's first 12 hex digits (same image, same name)."""
        repo = (self.tags[0] if self.tags else self.ref).rsplit("/", 1)[-1].split(":")[0]
        return f"{repo}-{self.id.split(':')[-1][:12]}"

    def env_dict(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.env if "=" in item)


def docker_client():
    from .engine import client

    return client()


def image_cuda(labels: dict[str, str], env: dict[str, str]) -> str | None:
    """The CUDA runtime the image's torch uses: its target's torch pin in targets.toml, else the
    CUDA_VERSION that NVIDIA's base images set. None when nothing says."""
    if TARGET_LABEL in labels:
        from wheelbuilder.targets import load

        try:
            return str(load().target(labels[TARGET_LABEL]).torch.cuda)
        except FatalError:
            pass
    return env.get("CUDA_VERSION")


def inspect_image(ref: str, client=None) -> ImageInfo:
    import docker

    client = client or docker_client()
    try:
        img = client.images.get(ref)
    except docker.errors.ImageNotFound:
        raise ExportError(f"image '{ref}' is not in the local engine. Build it first (`make image`).") from None
    cfg = img.attrs.get("Config") or {}
    env = list(cfg.get("Env") or [])
    labels = dict(cfg.get("Labels") or {})
    cuda = image_cuda(labels, dict(e.split("=", 1) for e in env if "=" in e))
    return ImageInfo(ref=ref, id=img.id, tags=list(img.tags), labels=labels, env=env,
                     entrypoint=list(cfg.get("Entrypoint") or []), cmd=list(cfg.get("Cmd") or []),
                     workdir=cfg.get("WorkingDir") or "/", user=cfg.get("User") or "", cuda=cuda)
