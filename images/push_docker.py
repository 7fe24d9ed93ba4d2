"""`push-docker`: ship dflash-train:<target> to a machine that has Docker but no registry, over SSH.

    check   the image is in the local engine; the host answers SSH (known_hosts), runs a Docker engine and
            has zstd; if the host's engine already holds this image ID, nothing is sent
    export  `docker save` through the engine API, compressed with zstd, to dist/images/<slug>.docker.tar.zst
            with its JSON record (reused while the image ID is the same)
    send    images/transfer.py's upload: resumable from a partial file, sha256-checked on the host, renamed
            into place atomically
    load    `zstd -dc FILE | docker load` on the host, then its image ID must equal ours (the ID is the
            digest of the image config, which names every layer's digest: same ID, same image)
    doctor  `docker run --rm --network none IMAGE doctor --quick` on the host; its verdict is the result

Why a file and not one `docker save | zstd | ssh docker load` pipe: a pipe that breaks at 90 % of a
10 GB image starts again from zero; the file resumes, and its checksum is verified before loading.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from common.fsutil import atomic_write, sha256_file

from . import export, ssh, transfer
from .errors import ExportError, PushError, TransferError
from .imageinfo import ImageInfo, inspect_image

REMOTE_DIR = "/var/tmp/dflash-images"
ZSTD_LEVEL = 3  # layers are mostly compressed wheels and .so files: higher levels cost time, gain little


@dataclass
class PushDockerOptions:
    host: str
    image: str
    out_dir: Path = export.DEFAULT_OUT
    remote_dir: str = REMOTE_DIR
    port: int = 22
    identity: str | None = None
    known_hosts: str | None = None
    accept_new_host_key: bool = False
    bwlimit_mb_s: float | None = None
    ssh_timeout_s: float = ssh.SSH_TIMEOUT  # the longest the host may stay silent (images/ssh.py)
    command_timeout_s: float = ssh.COMMAND_TIMEOUT  # the longest one command (docker load) may run there
    doctor: str = "doctor --quick"
    keep_file: bool = False
    progress: bool = True


@dataclass
class PushDockerReport:
    image_id: str
    status: str = ""  # "loaded" or "already-present"
    export_seconds: float = 0.0
    artifact_bytes: int = 0
    transfer: dict = field(default_factory=dict)
    load_seconds: float = 0.0
    doctor_rc: int | None = None
    doctor_output: str = ""


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def save_compressed(info: ImageInfo, out_dir: Path, progress: bool = True, name: str | None = None) -> tuple[Path, dict]:
    """dist/images/<slug>.docker.tar.zst (docker save | zstd) and its record; reused for the same image ID."""
    from .engine import client

    out_dir.mkdir(parents=True, exist_ok=True)
    artifact = out_dir / f"{info.slug}.docker.tar.zst"  # slug: name + image ID, so a record names one image
    record_path = artifact.with_name(artifact.name + ".json")
    if artifact.exists() and record_path.exists():
        record = json.loads(record_path.read_text())
        if record.get("image", {}).get("id") == info.id and record.get("size") == artifact.stat().st_size:
            say(f"reusing {artifact} (image {info.id[:19]})")
            return artifact, record
    tmp = artifact.with_name(artifact.name + ".tmp")
    img = client().images.get(info.id)
    size = int(img.attrs.get("Size") or 0)
    with open(tmp, "wb") as dst:
        zstd = subprocess.Popen(["zstd", "-q", f"-{ZSTD_LEVEL}", "-T0", "-c"], stdin=subprocess.PIPE, stdout=dst)
        with tqdm(total=size, unit="B", unit_scale=True, unit_divisor=1024, desc=f"save {info.slug}",
                  disable=not progress, leave=False) as bar:
            # named=True keeps the tag in the archive, so `docker load` tags the image on the host.
            for chunk in img.save(chunk_size=1 << 20, named=name or info.ref):
                zstd.stdin.write(chunk)
                bar.update(len(chunk))
        zstd.stdin.close()
        if zstd.wait() != 0:
            raise ExportError(f"zstd failed compressing the saved image into {tmp}.")
    tmp.replace(artifact)
    record = {"name": artifact.name, "format": "docker-archive+zstd", "size": artifact.stat().st_size,
              "sha256": sha256_file(artifact), "zstd_level": ZSTD_LEVEL, "image": asdict(info)}
    atomic_write(record_path, json.dumps(record, indent=2, sort_keys=True) + "\n")
    return artifact, record


def remote_image_id(host: ssh.SshHost, ref: str) -> str | None:
    r = host.run(["docker", "image", "inspect", "--format", "{{.Id}}", ref], check=False)
    return r.stdout.strip() if r.rc == 0 else None


def check_host(host: ssh.SshHost) -> str:
    """The host's Docker server version; TransferError naming the fix when docker or zstd is missing."""
    r = host.run(["docker", "version", "--format", "{{.Server.Version}}"], check=False)
    if r.rc != 0:
        raise TransferError(f"{host.hostname} has no Docker engine this user can reach (`docker version`: "
                            f"{(r.stderr or r.stdout).strip()[-300:]}). Install Docker there, start it, or add "
                            f"{host.user} to the docker group.")
    if host.run("command -v zstd", check=False).rc != 0:
        raise TransferError(f"{host.hostname} lacks zstd, which unpacks the image there. Install it "
                            "(apt install zstd / dnf install zstd).")
    return r.stdout.strip()


def push_docker(o: PushDockerOptions) -> PushDockerReport:
    ssh.parse_target(o.host)  # a malformed --host is refused before anything else
    try:
        info = inspect_image(o.image)
    except ExportError:
        raise ExportError(f"image '{o.image}' is not in the local engine, so there is nothing to send. Build it "
                          f"first: make image TARGET={o.image.rsplit(':', 1)[-1]}") from None
    tag = o.image  # the name it gets on the host (docker save records it)
    report = PushDockerReport(info.id)
    with ssh.SshHost(o.host, port=o.port, identity=o.identity, known_hosts=o.known_hosts,
                     accept_new_host_key=o.accept_new_host_key, ssh_timeout=o.ssh_timeout_s,
                     command_timeout=o.command_timeout_s) as host:
        version = check_host(host)
        say(f"host {host.hostname}: Docker {version}")
        if remote_image_id(host, info.id) == info.id:
            say(f"{host.hostname} already holds {info.id[:19]}; nothing to send")
            report.status = "already-present"
            if remote_image_id(host, tag) != info.id:
                host.run(["docker", "tag", info.id, tag])
        else:
            t0 = time.monotonic()
            artifact, record = save_compressed(info, Path(o.out_dir), o.progress, name=tag)
            report.export_seconds, report.artifact_bytes = time.monotonic() - t0, record["size"]
            r = transfer.send_file(host, artifact, o.remote_dir, sha256=record["sha256"], force=True,
                                   bwlimit_mb_s=o.bwlimit_mb_s, progress=o.progress)
            report.transfer = {"status": r.status, "bytes": r.bytes_sent, "seconds": r.seconds, "path": r.remote_path}
            say(f"{r.status}: {r.remote_path} ({r.bytes_sent / 1e6:.1f} MB at {r.rate_mb_s:.1f} MB/s)")
            t0 = time.monotonic()
            load = host.run(f"zstd -dc {shlex.quote(r.remote_path)} | docker load", check=False)
            report.load_seconds = time.monotonic() - t0
            if load.rc != 0:
                raise TransferError(f"`docker load` on {host.hostname} failed: {(load.stderr or load.stdout).strip()[-500:]}. "
                                    f"The verified file stays at {r.remote_path}; free space in Docker's data root "
                                    "there and run again.")
            arrived = remote_image_id(host, tag)
            if arrived != info.id:
                raise TransferError(f"{host.hostname} loaded {tag} as {arrived}, not {info.id}: the image changed "
                                    "on the way or the archive is not this image. Run again (the export is rebuilt "
                                    "when its record does not match).")
            say(f"loaded {tag} on {host.hostname}: image ID {arrived[:19]} matches")
            report.status = "loaded"
            if not o.keep_file:
                host.run(["rm", "-f", r.remote_path])
        if o.doctor:
            argv = ["docker", "run", "--rm", "--network", "none", tag, *shlex.split(o.doctor)]
            say(f"+ ssh {host.user}@{host.hostname} {shlex.join(argv)}")
            d = host.run(argv, check=False)
            report.doctor_rc, report.doctor_output = d.rc, d.stdout + d.stderr
            print(report.doctor_output, end="")
            if d.rc != 0:
                raise PushError(f"the image is on {host.hostname} but `{o.doctor}` failed there (exit {d.rc}); its "
                                f"report is above. Reproduce with: ssh {o.host} {shlex.join(argv)}")
            say(f"doctor on {host.hostname}: passed")
    return report


# ------------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------------

def _cmd(args: argparse.Namespace) -> int:
    report = push_docker(PushDockerOptions(
        host=args.host, image=export.image_from_args(args), out_dir=Path(args.out_dir), remote_dir=args.remote_dir,
        port=args.port, identity=args.identity, known_hosts=args.known_hosts,
        accept_new_host_key=args.accept_new_host_key, bwlimit_mb_s=args.bwlimit, ssh_timeout_s=args.ssh_timeout,
        command_timeout_s=args.command_timeout, doctor=args.doctor,
        keep_file=args.keep_file, progress=not args.json))
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("push-docker", help="stream the image to a Docker host over SSH and run its doctor",
                              formatter_class=argparse.RawDescriptionHelpFormatter, description=__doc__)
    p.add_argument("--host", required=True, help="USER@HOST with Docker (the user must reach its engine)")
    export.add_image_arguments(p)
    p.add_argument("--out-dir", default=str(export.DEFAULT_OUT), help="where the compressed save is kept and reused")
    p.add_argument("--remote-dir", default=REMOTE_DIR, help="where the file lands on the host before `docker load`")
    p.add_argument("--port", type=int, default=22)
    p.add_argument("--identity", help="private key file (default: agent and ~/.ssh keys)")
    p.add_argument("--known-hosts", help="known_hosts file (default: ~/.ssh/known_hosts and the system one)")
    p.add_argument("--accept-new-host-key", action="store_true", help="trust and record an unknown host key")
    p.add_argument("--bwlimit", type=float, help="upload cap in MB/s (10**6 bytes per second)")
    ssh.add_timeout_arguments(p)
    p.add_argument("--doctor", default="doctor --quick", help="command run in the image on the host ('' to skip)")
    p.add_argument("--keep-file", action="store_true", help="keep the file on the host after loading it")
    p.add_argument("--json", action="store_true", help="print the report as JSON at the end")
    p.set_defaults(func=_cmd)
