"""An image as a deterministic rootfs template for Proxmox VE < 9.1 and plain LXC.

    IMAGE-ID.tar.zst   `docker export` of a container, repacked: sorted entries (hard links last), mtimes
                       fixed to SOURCE_DATE_EPOCH, numeric owners, no ./.dockerenv or ./dev/*, zstd

`docker export` drops the image's ENV, ENTRYPOINT, WORKDIR and USER, and `pct exec`/`lxc-attach` would
not see them anyway (lxc.environment.runtime only reaches init's children), so the template carries them
as files:

    /etc/environment            KEY=VALUE (pam_env, login shells)
    /etc/profile.d/dflash.sh    export KEY='VALUE' ...   (sourced by the wrappers below)
    /usr/local/bin/dflash-env   runs "$@" with that environment, in WORKDIR, as USER   (scripts/dflash-env.sh)
    /usr/local/bin/<program>    dflash-env /abs/path "$@", for the entrypoint's program, `dflash`, and every program
                                in the image's own PATH directories (those before the system ones: the venv's
                                `python`, `torchrun` and console scripts), so that they are on the PATH that
                                `pct exec`, `lxc-attach`, ssh and login shells all search (each has /usr/local/bin)
    /etc/hosts                  only when the image's is empty or missing (`docker export` leaves Docker's empty
                                placeholder): localhost -> 127.0.0.1 and ::1, for torchrun and servers on localhost
    /sbin/init                  only when the image has none: mounts a /dev/shm tmpfs ($DFLASH_SHM_SIZE, default
                                half the memory), brings `lo` up, then waits for the halt signal   (scripts/init.sh)

The template is written under a temporary name in the output directory and renamed when complete.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import subprocess
import tarfile
import tempfile
from importlib import resources
from pathlib import Path

from tqdm import tqdm

from common.cmd import require_tool
from common.fsutil import source_date_epoch

from .errors import ExportError
from .imageinfo import ImageInfo, docker_client

WRAPPED_PROGRAMS = ("dflash", "dflash-train")  # besides the entrypoint's own program
# PATH directories every way into a container searches already: the image's programs elsewhere on its PATH
# (/opt/venv/bin) get a wrapper in /usr/local/bin. lxc-attach --clear-env, sshd's default and Debian's
# /etc/profile all list /usr/local/bin; pct exec passes the host shell's PATH, which lists it too.
SYSTEM_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
INIT_PROGRAMS = ("tini", "dumb-init", "--")  # entrypoint prefixes that are not the program itself
# What a distribution's /etc/hosts says about the loopback; pct --ostype unmanaged writes no /etc/hosts.
ETC_HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"

# Shell scripts written into the rootfs, kept as files in the package (images/scripts/).
_SCRIPTS = resources.files("images").joinpath("scripts")
ENV_WRAPPER = _SCRIPTS.joinpath("dflash-env.sh").read_text()
INIT_SHIM = _SCRIPTS.joinpath("init.sh").read_text()


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
    path_var = env.get("PATH", "")
    programs = [resolve_in_rootfs(p, path_var, members) for p in dict.fromkeys(entry + list(WRAPPED_PROGRAMS))]
    for real in dict.fromkeys([p for p in programs if p] + image_path_programs(path_var, members)):
        wrapper = f"./usr/local/bin/{os.path.basename(real)}"
        if "." + real != wrapper and wrapper not in files:  # the first of a name wins, as on PATH
            files[wrapper] = (f'#!/bin/sh\nexec /usr/local/bin/dflash-env {shlex.quote(real)} "$@"\n'.encode(), 0o755)
    hosts = members.get(through_links("./etc/hosts", members))
    if hosts is None or (hosts.isfile() and hosts.size == 0):
        files["./etc/hosts"] = (ETC_HOSTS.encode(), 0o644)
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


def image_path_programs(path_var: str, members: dict[str, tarfile.TarInfo]) -> list[str]:
    """The executables in the image's own PATH directories (those that are not SYSTEM_PATH), first
    directory first, as absolute paths: what `docker run IMAGE NAME` finds and a bare exec would not.
    A symlink counts when its target is in the rootfs (the venv's python -> /usr/bin/python3.11)."""
    found: dict[str, str] = {}
    for d in path_var.split(":"):
        d = d.rstrip("/")
        if not d.startswith("/") or d in SYSTEM_PATH:
            continue
        prefix = f".{d}/"
        for name in sorted(members):
            base = name[len(prefix):]
            if not name.startswith(prefix) or not base or "/" in base or base in found:
                continue
            if _executable(name, members):
                found[base] = name[1:]
    return list(found.values())


def _executable(name: str, members: dict[str, tarfile.TarInfo], depth: int = 0) -> bool:
    ti = members.get(name)
    if ti is None or depth > 8:
        return False
    if ti.issym():
        target = ti.linkname if ti.linkname.startswith("/") else os.path.join(os.path.dirname(name[1:]), ti.linkname)
        return _executable("." + os.path.normpath("/" + target.lstrip("/")), members, depth + 1)
    return ti.isfile() and bool(ti.mode & 0o111)


def resolve_in_rootfs(prog: str, path_var: str, members: dict[str, tarfile.TarInfo]) -> str | None:
    """Where `prog` lives in the rootfs, searching the image's PATH like execvp would."""
    if prog.startswith("/"):
        return prog if "." + prog in members else None
    for d in path_var.split(":"):
        if d and f".{d.rstrip('/')}/{prog}" in members:
            return f"{d.rstrip('/')}/{prog}"
    return None


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
    driver's, see `records.shadowing_libcuda`)."""
    zstd = require_tool("zstd", "compress the rootfs template", ExportError)
    epoch = source_date_epoch() if epoch is None else epoch
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
        try:
            libcuda = _repack(spool, tmp, info, epoch, [zstd, "-q", "-T0", f"-{level}", "-o", str(tmp), "-f"],
                              progress)
        except BaseException:  # Ctrl-C, SIGTERM, a full disk: no half-written template is left behind
            tmp.unlink(missing_ok=True)
            raise
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
            # What the build leaves in /tmp (torch's inductor cache, pip's files) belongs to no container.
            if ti.name.startswith("./tmp/"):
                continue
            members[ti.name] = ti
        # The builder's wheel folder, once its wheels are installed and removed, is only clutter.
        for folder in ("./wheels",):
            if folder in members and not any(n.startswith(folder + "/") for n in members):
                del members[folder]
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
        order = sorted(n for n in set(members) | set(extra) if not (n in members and members[n].islnk()))
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
            raise ExportError(f"zstd failed with exit code {rc} while writing {dest}; its message is above "
                              "(a full disk is the usual cause: free space there or pass another --out-dir).")
    return sorted(n[1:] for n in members if re.search(r"/libcuda\.so(\.|$)", n))
