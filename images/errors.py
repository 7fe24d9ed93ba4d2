"""The errors of the `dflash-images` program (`python -m images`), each with its own exit code.

The images program drives wheelbuilder (targets, builds) and the shared primitives (the subprocess
wrapper, the directory lock), so it raises their errors as well as its own. `ImagesError` therefore
subclasses `common.errors.FatalError` and the families share one range of exit codes: `__main__.main()`
runs the commands under `common.cli.run_cli`, which catches `FatalError`, prints the message and exits
with its code.

    1-7    common.errors, wheelbuilder.errors   configuration (2), toolchain (3), source (4), build (5),
                                                audit (6), busy (7)
    8      EngineError           no Docker engine, or not enough room on its disk
    9      ExportError           the image cannot be exported (missing image or tool, wrong media types)
    10     TransferError         the SSH host is unreachable, refused, or the upload did not verify
    11     HostKeyError          the host's SSH key is unknown or changed
    12     GpuError              the host's GPUs or driver cannot serve the image
    13     HostError             the Proxmox host cannot take the container as asked
    14     LxcError              LXC could not create, start or run a container
    15     PushError             the container came up but its health check failed
    16     RegistryError         the registry is unreachable, untrusted, refuses the credentials, or a tag
                                 already points to another image

Each message says what failed, the values seen, and what to do next.
"""

from __future__ import annotations

from common.errors import FatalError


class ImagesError(FatalError):
    """A failure of the images program that is not one of the shared ones."""


class EngineError(ImagesError):
    """No Docker engine answers, starting one failed, or its data root is too small for the build.
    Fix: start dockerd (`make engine` as root) or free space on its disk."""

    exit_code = 8


class ExportError(ImagesError):
    """The image cannot be exported: not in the engine, skopeo/zstd missing, non-OCI media types.
    Fix: build the image (`make image`) or install the tool the message names."""

    exit_code = 9


class TransferError(ImagesError):
    """The host could not be reached or refused, or the upload failed or did not verify.
    Fix: check sshd and the path on the host; a verified-failed upload is safe to run again."""

    exit_code = 10


class HostKeyError(TransferError):
    """The host's SSH key is not in known_hosts, or differs from the one recorded there.
    Fix: check the key and add it (or pass --accept-new-host-key on first contact)."""

    exit_code = 11


class GpuError(ImagesError):
    """The host's GPUs or driver cannot serve the image (missing nodes, driver too old, bad --gpus).
    Fix: load or upgrade the host driver, or choose other GPUs (--gpus) or none."""

    exit_code = 12


class HostError(ImagesError):
    """The Proxmox host cannot take this container as asked (version, storage, CTID, features, user).
    Fix: the option the message names (--format, --storage, --ctid/--replace, ...)."""

    exit_code = 13


class LxcError(ImagesError):
    """LXC could not create, start or run the container. Fix: see the LXC output and log it names."""

    exit_code = 14


class PushError(ImagesError):
    """The container was created but did not come up healthy. Fix: read the doctor's report printed
    above and inspect the container with the `pct exec` command the message gives."""

    exit_code = 15


class RegistryError(ImagesError):
    """The registry cannot take or give the image as asked: a reference without a namespace, no answer,
    a certificate from an unknown CA, credentials refused, or a tag that points to another image.
    Fix: the option the message names (--ca-cert, `docker login`, DFLASH_REGISTRY_USER/PASSWORD, --force)."""

    exit_code = 16
