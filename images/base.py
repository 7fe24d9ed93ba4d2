"""Bootstrap an offline Debian base image (`dflash-base:bookworm`) from a Debian mirror.

For machines that reach a Debian mirror but no container registry: `debootstrap --variant=minbase`
into a temporary directory, a deterministic tar of it (sorted names, numeric owners, mtimes clamped to
SOURCE_DATE_EPOCH), then `docker import` through the engine API. About a minute.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from common.cmd import echo, run
from common.fsutil import source_date_epoch

from .engine import client, image_exists
from .errors import EngineError

DEFAULT_TAG = "dflash-base:bookworm"
DEFAULT_SUITE = "bookworm"
DEFAULT_MIRROR = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")


def bootstrap(tag: str = DEFAULT_TAG, suite: str = DEFAULT_SUITE, mirror: str = DEFAULT_MIRROR,
              force: bool = False) -> str:
    """Create `tag` unless it exists; returns the image id."""
    if image_exists(tag) and not force:
        echo(f"{tag} exists (use --force to rebuild)")
        return client().images.get(tag).id
    if os.geteuid() != 0:
        raise EngineError("debootstrap needs root; run `make base` as root, or pull a Debian image and tag it " + tag)
    if not shutil.which("debootstrap"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        run(["apt-get", "update", "-qq"], env=env, error=EngineError)
        run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "debootstrap"], env=env, error=EngineError)
    epoch = source_date_epoch()
    with tempfile.TemporaryDirectory(prefix="dflash-base-") as tmp:
        root = Path(tmp) / "rootfs"
        echo(f"debootstrap {suite} from {mirror} (about a minute)")
        run(["debootstrap", "--variant=minbase", "--include=ca-certificates", suite, str(root), mirror],
            error=EngineError, log=Path(tmp) / "debootstrap.log")
        (root / "etc/apt/sources.list").write_text(
            f"deb {mirror} {suite} main\ndeb {mirror} {suite}-updates main\n"
            f"deb http://deb.debian.org/debian-security {suite}-security main\n")
        # Keep the image small and free of host-specific state.
        for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (root / sub).glob("*"):
                if p.is_file():
                    p.unlink()
        (root / "etc/apt/apt.conf.d/docker-clean").write_text(
            'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb || true"; };\n'
            'Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";\n')
        tar = Path(tmp) / "rootfs.tar"
        subprocess.run(["tar", "--sort=name", "--numeric-owner", f"--mtime=@{epoch}", "--clamp-mtime",
                        "--xattrs", "-C", str(root), "-cf", str(tar), "."], check=True)
        repo, _, version = tag.partition(":")
        echo(f"docker import -> {tag}")
        client().api.import_image(src=str(tar), repository=repo, tag=version or "latest",
                                  changes=["ENV LANG=C.UTF-8", 'CMD ["/bin/bash"]'])
    return client().images.get(tag).id
