"""An image as an OCI archive for Proxmox VE >= 9.1.

    IMAGE-ID.oci.tar   uncompressed tar of an OCI layout (oci-layout, index.json, blobs/) with OCI media
                       types, written by `skopeo copy docker-daemon: oci-archive:`; PVE >= 9.1 only takes
                       this shape (pve-container `archive_is_oci_format`; proxmox-oci rejects Docker media
                       types, which is why `docker save` output does not do)

The archive is written under a temporary name in the output directory and renamed once checked.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tarfile
from pathlib import Path

from common.cmd import require_tool

from .errors import ExportError
from .imageinfo import ImageInfo

OCI_MEDIA_PREFIX = "application/vnd.oci."


def export_oci(info: ImageInfo, out_dir: Path) -> Path:
    """`skopeo copy docker-daemon:IMG oci-archive:OUT` then check that every media type is OCI."""
    skopeo = require_tool("skopeo", "write an OCI archive", ExportError)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"{info.slug}.oci.tar"
    tmp = out_dir / f".{final.name}.tmp"
    tmp.unlink(missing_ok=True)
    src = info.tags[0] if info.tags else info.id.split(":")[-1]
    tag = src.rsplit(":", 1)[-1] if ":" in src.rsplit("/", 1)[-1] else "latest"
    cmd = [skopeo, "copy", "--quiet", f"docker-daemon:{src}", f"oci-archive:{tmp}:{tag}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise ExportError(f"`{shlex.join(cmd)}` failed: {proc.stderr.strip()[-800:]}")
    check_oci_archive(tmp)
    os.replace(tmp, final)
    return final


def check_oci_archive(path: Path) -> dict:
    """Open the archive like PVE does: oci-layout + index.json + blobs/, OCI media types only.

    Returns the manifest. Raises ExportError naming the first non-OCI media type."""
    with tarfile.open(path) as tar:
        names = set(tar.getnames())
        for needed in ("oci-layout", "index.json"):
            if needed not in names and f"./{needed}" not in names:
                raise ExportError(f"{path.name} is not an OCI layout archive: no {needed}.")

        def blob(digest: str) -> bytes:
            algo, hexd = digest.split(":", 1)
            member = tar.getmember(f"blobs/{algo}/{hexd}")
            return tar.extractfile(member).read()

        index = json.loads(tar.extractfile("index.json").read())
        desc = index["manifests"][0]
        manifest = json.loads(blob(desc["digest"]))
    types = [desc.get("mediaType", ""), manifest.get("mediaType", ""), manifest["config"]["mediaType"]]
    types += [layer["mediaType"] for layer in manifest["layers"]]
    bad = [t for t in types if not t.startswith(OCI_MEDIA_PREFIX)]
    if bad:
        raise ExportError(
            f"{path.name} holds non-OCI media types {sorted(set(bad))}; Proxmox rejects them. Convert with "
            "`skopeo copy` to oci-archive (this command does), not `docker save`."
        )
    return manifest
