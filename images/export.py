"""Export an image for Proxmox: an OCI archive (PVE >= 9.1) or a deterministic rootfs template.

    oci       IMAGE-ID.oci.tar   uncompressed tar of an OCI layout (oci-layout, index.json, blobs/) with
                                 OCI media types, written by `skopeo copy docker-daemon: oci-archive:`;
                                 PVE >= 9.1 only takes this shape (pve-container `archive_is_oci_format`,
                                 Docker media types are rejected by proxmox-oci)
    template  IMAGE-ID.tar.zst   `docker export` of a container, repacked: sorted entries, mtimes fixed to
                                 SOURCE_DATE_EPOCH, numeric owners, zstd; for PVE < 9.1 and plain LXC

`docker export` drops the image's ENV, ENTRYPOINT, WORKDIR and USER, and `pct exec`/`lxc-attach` would
not see them anyway (lxc.environment.runtime only reaches init's children), so the template carries them
as files:

    /etc/environment            KEY=VALUE (pam_env, login shells)
    /etc/profile.d/dflash.sh    export KEY='VALUE' ...   (sourced by the wrappers below)
    /usr/local/bin/dflash-env   runs "$@" with that environment, in WORKDIR, as USER
    /usr/local/bin/<program>    for the entrypoint's program and `dflash`: dflash-env /abs/path "$@"
    /sbin/init                  only when the image has none: waits for the halt signal (LXC needs an init)

Each artifact gets NAME.json beside it (name, size, sha256, image id, labels, config). Files are written
under a temporary name in the same directory and renamed when complete.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from wheelbuilder.errors import FatalError

DEFAULT_OUT = Path("dist/images")
OCI_MEDIA_PREFIX = "application/vnd.oci."
WRAPPED_PROGRAMS = ("dflash", "dflash-train")  # besides the entrypoint's own program
INIT_PROGRAMS = ("tini", "dumb-init", "--")  # entrypoint prefixes that are not the program itself
CUDA_LABELS = ("org.dflash.cuda", "io.dflash.cuda")
TARGET_LABEL = "io.dflash.target"  # set by the Dockerfile; targets.toml knows its torch's CUDA


class ExportError(FatalError):
    """The image cannot be exported (missing image, missing tool, wrong media types)."""

    exit_code = 9


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
    """The CUDA runtime the image's torch uses: a CUDA label, else its target's torch pin in
    targets.toml, else the CUDA_VERSION that NVIDIA's base images set. None when nothing says."""
    for key in CUDA_LABELS:
        if key in labels:
            return labels[key]
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


# ------------------------------------------------------------------------------------------------------
# Records and atomic writes
# ------------------------------------------------------------------------------------------------------

def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def write_record(artifact: Path, info: ImageInfo, fmt: str, **extra) -> dict:
    """NAME.json beside the artifact: what it is, how big, its sha256 and the image it came from."""
    record = {"name": artifact.name, "format": fmt, "size": artifact.stat().st_size,
              "sha256": sha256_of(artifact), "image": asdict(info), **extra}
    tmp = artifact.with_name(f".{artifact.name}.json.tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, record_path(artifact))
    return record


def record_path(artifact: Path) -> Path:
    return artifact.with_name(artifact.name + ".json")


def read_record(artifact: Path) -> dict:
    path = record_path(artifact)
    if not path.exists():
        raise ExportError(f"{artifact} has no record {path.name} beside it; export it again with `export`.")
    return json.loads(path.read_text())


def _require(tool: str, why: str) -> str:
    found = shutil.which(tool)
    if not found:
        raise ExportError(f"'{tool}' is not installed; it is needed to {why}. Install it (apt install {tool}).")
    return found


# ------------------------------------------------------------------------------------------------------
# OCI archive
# ------------------------------------------------------------------------------------------------------

def export_oci(info: ImageInfo, out_dir: Path) -> Path:
    """`skopeo copy docker-daemon:IMG oci-archive:OUT` then check that every media type is OCI."""
    skopeo = _require("skopeo", "write an OCI archive")
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


# ------------------------------------------------------------------------------------------------------
# Rootfs template
# ------------------------------------------------------------------------------------------------------

def carried_files(info: ImageInfo, members: dict[str, tarfile.TarInfo],
                  existing_environment: bytes = b"") -> dict[str, tuple[bytes, int]]:
    """The files that carry the image config into the rootfs: {'./path': (content, mode)}."""
    env = info.env_dict()
    env_lines = "".join(f"{k}={v}\n" for k, v in env.items())
    meta = {"DFLASH_IMAGE_ID": info.id, "DFLASH_IMAGE_WORKDIR": info.workdir, "DFLASH_IMAGE_USER": info.user}
    profile = "# Written by dflash-images export: the image's ENV, for pct exec / lxc-attach.\n"
    profile += "".join(f"export {k}={shlex.quote(v)}\n" for k, v in {**env, **meta}.items())
    files = {
        "./etc/environment": (existing_environment + env_lines.encode(), 0o644),
        "./etc/profile.d/dflash.sh": (profile.encode(), 0o644),
        "./usr/local/bin/dflash-env": (ENV_WRAPPER.encode(), 0o755),
    }
    entry = [w for w in info.entrypoint if os.path.basename(w) not in INIT_PROGRAMS][:1]
    for prog in dict.fromkeys(entry + list(WRAPPED_PROGRAMS)):
        real = resolve_in_rootfs(prog, env.get("PATH", ""), members)
        wrapper = f"./usr/local/bin/{os.path.basename(prog)}"
        if real and "." + real != wrapper:
            files[wrapper] = (f'#!/bin/sh\nexec /usr/local/bin/dflash-env {shlex.quote(real)} "$@"\n'.encode(), 0o755)
    init = through_links("./sbin/init", members)
    if init not in members:
        files[init] = (INIT_SHIM.encode(), 0o755)
    return {through_links(k, members): v for k, v in files.items()}


def through_links(path: str, members: dict[str, tarfile.TarInfo]) -> str:
    """Rewrite `path` through symlinked parent directories of the rootfs (merged /usr: ./sbin ->
    usr/sbin), so a tar entry never has to be written through a link whose target comes later."""
    parts = path.removeprefix("./").split("/")
    for _ in range(40):  # bounded: a link loop in an image must not hang the export
        for i in range(1, len(parts)):
            ti = members.get("./" + "/".join(parts[:i]))
            if ti is not None and ti.issym():
                target = ti.linkname
                base = [] if target.startswith("/") else parts[:i - 1]
                resolved = os.path.normpath("/".join(base + [target.lstrip("/")])).split("/")
                parts = resolved + parts[i:]
                break
        else:
            return "./" + "/".join(parts)
    raise ExportError(f"symlink loop while resolving {path} in the image's rootfs.")


def resolve_in_rootfs(prog: str, path_var: str, members: dict[str, tarfile.TarInfo]) -> str | None:
    """Where `prog` lives in the rootfs, searching the image's PATH like execvp would."""
    if prog.startswith("/"):
        return prog if "." + prog in members else None
    for d in path_var.split(":"):
        if d and f".{d.rstrip('/')}/{prog}" in members:
            return f"{d.rstrip('/')}/{prog}"
    return None


ENV_WRAPPER = """#!/bin/sh
# Run a command with the image's environment, working directory and user (dflash-images export).
set -e
. /etc/profile.d/dflash.sh
cd "${DFLASH_IMAGE_WORKDIR:-/}"
u="${DFLASH_IMAGE_USER%%:*}"
if [ "$(id -u)" = 0 ] && [ -n "$u" ] && [ "$u" != root ] && [ "$u" != 0 ]; then
  case "$u" in
    *[!0-9]*) exec runuser -u "$u" -- "$@" ;;
    *) g="${DFLASH_IMAGE_USER#*:}"; exec setpriv --reuid="$u" --regid="${g:-$u}" --clear-groups -- "$@" ;;
  esac
fi
exec "$@"
"""

INIT_SHIM = """#!/bin/sh
# Minimal init for a container made from an image without one: stay up until LXC asks to halt
# (SIGPWR, lxc.signal.halt) or stop; training runs through `pct exec`.
trap 'exit 0' PWR TERM INT
while :; do sleep 3600 & wait $!; done
"""


def _normalize(ti: tarfile.TarInfo, epoch: int) -> tarfile.TarInfo:
    name = ti.name.lstrip("/").removeprefix("./")
    ti.name = "./" + name if name not in ("", ".") else "."
    ti.mtime = epoch
    ti.uname = ti.gname = ""  # numeric owners only: names differ between hosts
    ti.pax_headers = {k: v for k, v in ti.pax_headers.items() if k.startswith("SCHILY.xattr.")}
    return ti


def export_template(info: ImageInfo, out_dir: Path, *, epoch: int | None = None, level: int = 10,
                    client=None, progress: bool = True) -> tuple[Path, list[str]]:
    """`docker create` + `docker export`, repacked deterministically into NAME.tar.zst.

    Returns the template and the libcuda files the image ships itself (they can shadow the host
    driver's, see `shadowing_libcuda`)."""
    zstd = _require("zstd", "compress the rootfs template")
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "0")) if epoch is None else epoch
    client = client or docker_client()
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"{info.slug}.tar.zst"
    tmp = out_dir / f".{final.name}.tmp"
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".export-") as work:
        spool = Path(work) / "export.tar"
        container = client.containers.create(info.id, entrypoint=["/bin/true"], network_mode="none")
        try:
            with open(spool, "wb") as f, tqdm(unit="B", unit_scale=True, desc="docker export",
                                               disable=not progress) as bar:
                for chunk in container.export(chunk_size=1 << 20):
                    f.write(chunk)
                    bar.update(len(chunk))
        finally:
            container.remove(force=True)
        libcuda = _repack(spool, tmp, info, epoch, [zstd, "-q", "-T0", f"-{level}", "-o", str(tmp), "-f"], progress)
    os.replace(tmp, final)
    return final, libcuda


def _repack(spool: Path, dest: Path, info: ImageInfo, epoch: int, zstd_cmd: list[str], progress: bool) -> list[str]:
    with tarfile.open(spool) as src:
        members = {}
        for ti in src.getmembers():
            ti = _normalize(ti, epoch)
            # .dockerenv says "running under Docker" (untrue in LXC); device nodes cannot be created
            # in an unprivileged container and pct skips ./dev/* on restore anyway.
            if ti.name == "./.dockerenv" or ti.name.startswith("./dev/"):
                continue
            members[ti.name] = ti
        env_member = members.get("./etc/environment")
        existing = src.extractfile(env_member).read() if env_member is not None and env_member.isfile() else b""
        extra = carried_files(info, members, existing)
        for path in extra:  # parents must exist in the tar for LXC to unpack the files
            parent = os.path.dirname(path)
            while parent not in (".", "") and parent not in members:
                d = tarfile.TarInfo(parent)
                d.type, d.mode = tarfile.DIRTYPE, 0o755
                members[parent] = _normalize(d, epoch)
                parent = os.path.dirname(parent)
        # Hard links after everything else: their targets must already be unpacked.
        order = sorted((n for n in set(members) | set(extra) if not (n in members and members[n].islnk())))
        order += sorted(n for n in members if members[n].islnk() and n not in extra)
        proc = subprocess.Popen(zstd_cmd, stdin=subprocess.PIPE)
        try:
            with tarfile.open(fileobj=proc.stdin, mode="w|", format=tarfile.PAX_FORMAT) as out:
                for name in tqdm(order, desc="repack", unit="file", disable=not progress):
                    if name in extra:
                        data, mode = extra[name]
                        ti = tarfile.TarInfo(name)
                        ti.size, ti.mode, ti.mtime = len(data), mode, epoch
                        out.addfile(ti, io.BytesIO(data))
                        continue
                    ti = members[name]
                    if ti.islnk():
                        ti.linkname = "./" + ti.linkname.lstrip("/").removeprefix("./")
                    out.addfile(ti, src.extractfile(ti) if ti.isfile() else None)
        finally:
            proc.stdin.close()
            rc = proc.wait()
        if rc != 0:
            dest.unlink(missing_ok=True)
            raise ExportError(f"zstd failed with exit code {rc} while writing {dest}.")
    return sorted(n[1:] for n in members if re.search(r"/libcuda\.so(\.|$)", n))


def shadowing_libcuda(record: dict) -> list[str]:
    """libcuda files of the image that the loader would pick before the host driver's bind-mounted one:
    those in a directory of the image's LD_LIBRARY_PATH (e.g. a CUDA forward-compat package)."""
    env = dict(e.split("=", 1) for e in record.get("image", {}).get("env", []) if "=" in e)
    dirs = {d.rstrip("/") for d in env.get("LD_LIBRARY_PATH", "").split(":") if d}
    return [p for p in record.get("libcuda_in_image", []) if os.path.dirname(p) in dirs]


# ------------------------------------------------------------------------------------------------------
# Entry points
# ------------------------------------------------------------------------------------------------------

@dataclass
class ExportResult:
    artifacts: list[Path] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


def export(image: str, fmt: str, out_dir: Path, *, epoch: int | None = None, level: int = 10,
           progress: bool = True) -> ExportResult:
    """Export `image` as 'oci', 'template' or 'both'; each artifact gets its JSON record."""
    if fmt not in ("oci", "template", "both"):
        raise ExportError(f"--format '{fmt}' is not one of oci, template, both.")
    info = inspect_image(image)
    result = ExportResult()
    for kind in (("oci", "template") if fmt == "both" else (fmt,)):
        t0 = time.monotonic()
        if kind == "oci":
            path = export_oci(info, out_dir)
            extra = {}
        else:
            e = int(os.environ.get("SOURCE_DATE_EPOCH", "0")) if epoch is None else epoch
            path, libcuda = export_template(info, out_dir, epoch=e, level=level, progress=progress)
            extra = {"source_date_epoch": e, "zstd_level": level, "libcuda_in_image": libcuda}
        result.seconds[kind] = time.monotonic() - t0
        result.artifacts.append(path)
        result.records.append(write_record(path, info, kind, **extra))
    return result


def _cmd_export(args: argparse.Namespace) -> int:
    result = export(args.image, args.format, Path(args.out_dir), epoch=args.source_date_epoch, level=args.zstd_level)
    for rec, path in zip(result.records, result.artifacts):
        print(f"{path}  {rec['size'] / 1e6:.1f} MB  sha256 {rec['sha256']}  ({result.seconds[rec['format']]:.1f}s)")
    return 0


def register(subparsers) -> None:
    """Add `export` to the images CLI."""
    p = subparsers.add_parser("export", help="export an image as an OCI archive (PVE >= 9.1) or a rootfs template",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--image", default="dflash-train:latest", help="image in the local engine")
    p.add_argument("--format", choices=("oci", "template", "both"), default="both")
    p.add_argument("--out-dir", default=str(DEFAULT_OUT))
    p.add_argument("--source-date-epoch", type=int, default=None,
                   help="mtime of every template entry (default: $SOURCE_DATE_EPOCH or 0)")
    p.add_argument("--zstd-level", type=int, default=10)
    p.set_defaults(func=_cmd_export)
