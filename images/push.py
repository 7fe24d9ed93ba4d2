"""`push`: ship an image to a Proxmox host as an LXC container with the GPUs passed through.

    connect (known_hosts) -> read the host -> check the plan  (every refusal before any export or upload)
    -> export (reused when dist/images already holds this image id) -> upload (resumable, verified)
    -> [pct destroy with --replace] -> pct create -> pct set --devN -> raw lxc.* lines -> pct start
    -> ldconfig (host driver libraries) -> dflash doctor inside, through pct exec

`--from-registry REF` (PVE >= 9.1): no export and no upload; the host pulls the published image itself
through its storage API (`pvesh create /nodes/NODE/storage/STORAGE/oci-registry-pull`, which runs skopeo),
after this machine has read the image's config from the registry for the same checks; on arrival the
archive's layer diff IDs must be the ones read here.

`--dry-run` reads the host (read-only commands only) and prints every command and file it would send.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import export, proxmox, records, registry, ssh, transfer
from .errors import HostError, PushError, RegistryError, TransferError
from .imageinfo import ImageInfo, image_cuda, inspect_image

EXTENSIONS = {"oci": ".oci.tar", "template": ".tar.zst"}


@dataclass
class PushOptions:
    host: str
    ctid: int
    image: str  # in the local engine; the CLI defaults it to dflash-train:<target>
    format: str = "auto"  # auto, oci, template
    out_dir: Path = export.DEFAULT_OUT
    port: int = 22
    identity: str | None = None
    known_hosts: str | None = None
    accept_new_host_key: bool = False
    compress: bool = False
    force: bool = False
    dry_run: bool = False
    start: bool = True
    doctor: str = "dflash doctor"
    pve_config_dir: str = "/etc/pve/lxc"
    bwlimit_mb_s: float | None = None  # upload cap, MB/s (10**6 bytes per second)
    ssh_timeout_s: float = ssh.SSH_TIMEOUT  # the longest the host may stay silent (images/ssh.py)
    command_timeout_s: float = ssh.COMMAND_TIMEOUT  # the longest one command may run on the host
    from_registry: str | None = None  # host/namespace/name:tag the host pulls itself (PVE >= 9.1)
    ca_cert: str | None = None  # the registry's CA, for reading the image's config from here
    plan: dict = field(default_factory=dict)  # ContainerPlan fields other than ctid/template/fmt


@dataclass
class PushReport:
    steps: list[dict] = field(default_factory=list)
    doctor_output: str = ""

    def step(self, what: str, **info) -> None:
        self.steps.append({"step": what, **info})


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def push(o: PushOptions) -> PushReport:
    proxmox.check_ctid(o.ctid)  # what is wrong in the options themselves: refused before any connection
    ssh.parse_target(o.host)
    report = PushReport()
    ref = registry.parse_reference(o.from_registry) if o.from_registry else None
    info, layers = registry_image(ref, o.ca_cert) if ref else (inspect_image(o.image), [])
    with ssh.SshHost(o.host, port=o.port, identity=o.identity, known_hosts=o.known_hosts,
                     accept_new_host_key=o.accept_new_host_key, compress=o.compress, ssh_timeout=o.ssh_timeout_s,
                     command_timeout=o.command_timeout_s) as host:
        facts = proxmox.gather_facts(host, o.plan.get("gpus", "all"))
        if ref:
            _check_pull(facts, o)
        fmt = "oci" if ref else (o.format if o.format != "auto" else (
            "oci" if facts.pve >= proxmox.OCI_MIN_PVE else "template"))
        artifact = Path(o.out_dir) / (proxmox.pull_filename(ref.repository, ref.tag, info.id) + ".tar" if ref
                                      else f"{info.slug}{EXTENSIONS[fmt]}")
        plan = proxmox.ContainerPlan(ctid=o.ctid, template=artifact.name, fmt=fmt, **o.plan)
        devices = proxmox.check_plan(plan, facts, info.cuda)
        say(f"host {host.hostname}: Proxmox VE {facts.pve}, {sum(d.gpu_index is not None for d in devices)} GPU(s) "
            f"passed through, format {fmt}" + (f", driver {facts.driver.text}" if facts.driver else ""))

        template_dir = str(Path(host.run(["pvesm", "path", plan.volid]).stdout.strip()).parent)
        if ref:
            _pull(host, ref, layers, plan, template_dir, o.dry_run, report)
            record = {}
        else:
            record = _artifact(info, fmt, artifact, o, report)
        _refuse_shadowing_libcuda(record, facts, devices)
        if not ref:
            _send(host, artifact, template_dir, record, o, report)
        _create(host, plan, facts, devices, o, report)
        if o.start:
            _start(host, plan, facts, devices, fmt, info, o, report)
    return report


def _check_pull(facts, o: PushOptions) -> None:
    """--from-registry needs a host that pulls OCI images itself, and the OCI format."""
    if facts.pve < proxmox.PULL_MIN_PVE:
        raise HostError(f"the host runs Proxmox VE {facts.pve}; pulling from a registry (oci-registry-pull) "
                        f"needs PVE >= {proxmox.PULL_MIN_PVE}. Push without --from-registry (the image is "
                        "exported here and sent over SSH).")
    if o.format == "template":
        raise HostError("--from-registry pulls an OCI archive; drop --format template.")


def _refuse_shadowing_libcuda(record: dict, facts, devices) -> None:
    """An image's own libcuda on its library path would hide the host driver's from the GPUs passed through."""
    shadow = records.shadowing_libcuda(record) if devices else []
    if shadow:
        raise HostError(
            f"the image ships its own libcuda ({', '.join(shadow)}) on its LD_LIBRARY_PATH; it would be loaded "
            f"instead of the host driver's {facts.driver.text} libraries and fail with 'driver/library version "
            "mismatch'. Remove it from the image (or from LD_LIBRARY_PATH) and export again.")


def _send(host, artifact: Path, template_dir: str, record: dict, o: PushOptions, report: PushReport) -> None:
    """The exported artifact into the host's template storage (resumable, checksummed), or what would be sent."""
    if o.dry_run:
        say(f"would send {artifact} ({_size(record)}, sha256 {record.get('sha256', 'after export')}) "
            f"to {host.hostname}:{template_dir}/{artifact.name}")
        return
    r = transfer.send_file(host, artifact, template_dir, sha256=record["sha256"], force=o.force,
                           bwlimit_mb_s=o.bwlimit_mb_s)
    say(f"{r.status}: {r.remote_path} ({r.bytes_sent / 1e6:.1f} MB at {r.rate_mb_s:.1f} MB/s)")
    report.step("transfer", status=r.status, path=r.remote_path, bytes=r.bytes_sent, seconds=r.seconds)


def _create(host, plan, facts, devices, o: PushOptions, report: PushReport) -> None:
    """pct create (after stop and destroy of the container it replaces), pct set, then the raw config lines."""
    commands: list[list[str]] = []
    if plan.replace and plan.ctid in facts.ctids:
        commands += [["pct", "stop", str(plan.ctid)], ["pct", "destroy", str(plan.ctid), "--purge"]]
    commands.append(proxmox.render_create(plan))
    commands += proxmox.render_set(plan, facts, devices)
    raw = (proxmox.render_ipc_config(plan) + proxmox.render_net_config(plan)
           + proxmox.render_raw_config(facts, devices))
    conf = f"{o.pve_config_dir.rstrip('/')}/{plan.ctid}.conf"
    for argv in commands:
        _run(host, argv, o.dry_run, report, check=argv[1] != "stop")
    if raw:
        text = "".join(line + "\n" for line in raw)
        if o.dry_run:
            say(f"would append to {host.hostname}:{conf}:\n{text}")
        else:
            host.run(f"cat >> {shlex.quote(conf)}", stdin=text.encode())
        report.step("config", path=conf, lines=raw)


def _start(host, plan, facts, devices, fmt: str, info, o: PushOptions, report: PushReport) -> None:
    """pct start, ldconfig where host libraries were bound in, then the doctor inside (its failure is fatal)."""
    _run(host, ["pct", "start", str(plan.ctid)], o.dry_run, report)
    if facts.libraries and devices:
        _run(host, ["pct", "exec", str(plan.ctid), "--", "ldconfig"], o.dry_run, report)
    if not o.doctor:
        return
    argv = ["pct", "exec", str(plan.ctid), "--", *doctor_argv(fmt, info, o.doctor)]
    result = _run(host, argv, o.dry_run, report, check=False)
    if result is not None:
        report.doctor_output = result.stdout + result.stderr
        print(report.doctor_output, end="")
        if result.rc != 0:
            raise PushError(
                f"container {plan.ctid} is up but `{o.doctor}` failed inside it (exit {result.rc}); its "
                f"report is above. Inspect with: ssh {o.host} pct exec {plan.ctid} -- {doctor_hint(fmt, o.doctor)}")


def registry_image(ref: registry.Reference, ca_cert: str | None) -> tuple[ImageInfo, list[str]]:
    """What the published image's config says, read from the registry (no local image needed), and its
    layers' diff IDs (the sha256 of each uncompressed layer)."""
    if ref.digest or not ref.tag:
        raise RegistryError(f"--from-registry {ref}: the host's oci-registry-pull takes host/name:tag only (no "
                            "@digest); give the tag `publish` printed.")
    client = registry.Registry(ref.registry, registry.credentials(ref.registry),
                               registry.trusted_ca(ref.registry, ca_cert))
    client.ping()
    manifest = client.manifest(ref.repository, ref.tag)
    if manifest is None:
        raise RegistryError(f"{ref} is not in the registry. Publish it first: make publish TARGET=... "
                            f"REGISTRY={ref.registry}/{ref.repository.rsplit('/', 1)[0]}")
    if not manifest.config_digest:
        raise RegistryError(f"{ref} is an index ({manifest.media_type}); give the tag of one linux/amd64 image.")
    whole = json.loads(client.blob(ref.repository, manifest.config_digest))
    cfg = whole.get("config") or {}
    env = list(cfg.get("Env") or [])
    labels = dict(cfg.get("Labels") or {})
    return ImageInfo(ref=str(ref), id=manifest.config_digest, tags=[str(ref)], labels=labels, env=env,
                     entrypoint=list(cfg.get("Entrypoint") or []), cmd=list(cfg.get("Cmd") or []),
                     workdir=cfg.get("WorkingDir") or "/", user=cfg.get("User") or "",
                     cuda=image_cuda(labels, dict(e.split("=", 1) for e in env if "=" in e))), \
        list((whole.get("rootfs") or {}).get("diff_ids") or [])


def _pull(host: ssh.SshHost, ref: registry.Reference, layers: list[str], plan: proxmox.ContainerPlan,
          template_dir: str, dry_run: bool, report: PushReport) -> None:
    """The host pulls `ref` into its template storage, unless the file of this very image is there."""
    path = f"{template_dir}/{plan.template}"
    if host.run(["test", "-f", path], check=False).rc == 0:
        say(f"{host.hostname}:{path} is already there (its name holds the config digest)")
        report.step("pull", reference=str(ref), path=path, reused=True)
    else:
        node = host.run("hostname", check=False).stdout.strip() or "localhost"
        argv = proxmox.render_pull(node, plan.template_storage, f"{ref.name}:{ref.tag}",
                                   plan.template.removesuffix(".tar"))
        result = _run(host, argv, dry_run, report, check=False)
        if result is None:
            return
        if result.rc != 0:
            text = (result.stderr or result.stdout).strip()
            fix = ("put the registry's CA in /etc/containers/certs.d/" + ref.registry + "/ca.crt on the host"
                   if "x509" in text or "certificate" in text else
                   f"log the host in (`skopeo login {ref.registry}` as root there)" if "unauthorized" in text
                   or "authentication required" in text else "read skopeo's message above")
            raise HostError(f"the host could not pull {ref} (exit {result.rc}): {text[-600:]}\nFix: {fix}.")
    if dry_run:
        return
    # Same image? skopeo rewrites the config when it converts Docker media types to OCI (so its digest
    # changes), but the diff IDs (sha256 of each uncompressed layer) it lists stay those read here.
    def member(name: str) -> dict:
        return json.loads(host.run(f"tar -xOf {shlex.quote(path)} {shlex.quote(name)}").stdout)

    try:
        manifest = member(f"blobs/{member('index.json')['manifests'][0]['digest'].replace(':', '/')}")
        arrived = member(f"blobs/{manifest['config']['digest'].replace(':', '/')}")["rootfs"]["diff_ids"]
    except (ValueError, KeyError, IndexError, TransferError) as e:
        raise HostError(f"{host.hostname}:{path} is not a readable OCI archive ({e}). Delete it and push again.") from None
    if arrived != layers:
        raise HostError(f"{host.hostname}:{path} holds other layers than {ref} has now ({len(arrived)} vs "
                        f"{len(layers)}; the tag moved between the check and the pull?). Delete that file and "
                        "push again.")
    say(f"pulled {ref} on {host.hostname}: its {len(layers)} layer digests match the registry's")


def doctor_argv(fmt: str, info: ImageInfo, doctor: str) -> list[str]:
    """The doctor command inside the container, with the image's environment (pct exec has none of it).

    Templates carry /usr/local/bin/dflash-env; an OCI container gets the recorded Env and WORKDIR."""
    if fmt == "template":
        return ["/usr/local/bin/dflash-env", *shlex.split(doctor)]
    return ["env", "-i", *info.env, "sh", "-c", f"cd {shlex.quote(info.workdir)} && exec {doctor}"]


def doctor_hint(fmt: str, doctor: str) -> str:
    return f"/usr/local/bin/dflash-env {doctor}" if fmt == "template" else doctor


def _artifact(info: ImageInfo, fmt: str, artifact: Path, o: PushOptions, report: PushReport) -> dict:
    """The exported artifact's record: reused when it is of this very image, else exported now."""
    if artifact.exists() and records.record_path(artifact).exists():
        record = records.read_record(artifact)
        if record["image"]["id"] == info.id and record["size"] == artifact.stat().st_size:
            say(f"reusing {artifact} (image {info.id[:19]})")
            report.step("export", path=str(artifact), reused=True)
            return record
    if o.dry_run:
        say(f"would export {o.image} as {fmt} to {artifact}")
        report.step("export", path=str(artifact), reused=False, dry_run=True)
        return {}
    t0 = time.monotonic()
    result = export.export(o.image, fmt, Path(o.out_dir))
    report.step("export", path=str(result.artifacts[0]), reused=False, seconds=time.monotonic() - t0)
    return result.records[0]


def _size(record: dict) -> str:
    return f"{record['size'] / 1e6:.1f} MB" if record else "size after export"


def _run(host: ssh.SshHost, argv: list[str], dry_run: bool, report: PushReport, check: bool = True):
    cmd = shlex.join(argv)
    say(f"+ ssh {host.user}@{host.hostname} {cmd}")
    report.step("run", command=cmd, dry_run=dry_run)
    if dry_run:
        return None
    return host.run(argv, check=check)


# ------------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------------

def _cmd_push(args: argparse.Namespace) -> int:
    plan = dict(hostname=args.hostname, cores=args.cores, memory_mb=args.memory, swap_mb=args.swap,
                rootfs_storage=args.rootfs_storage, rootfs_gb=args.rootfs_size, data_storage=args.data_storage,
                data_gb=args.data_size, data_path=args.data_path, features=args.features,
                unprivileged=not args.privileged, net0=args.net0 or None, gpus=args.gpus,
                replace=args.replace, template_storage=args.storage, entrypoint=args.entrypoint,
                shm_mb=args.shm_size)
    opts = PushOptions(host=args.host, ctid=args.ctid, image=export.image_from_args(args), format=args.format, out_dir=Path(args.out_dir),
                       port=args.port, identity=args.identity, known_hosts=args.known_hosts,
                       accept_new_host_key=args.accept_new_host_key, compress=args.compress, force=args.force,
                       dry_run=args.dry_run, start=not args.no_start, doctor=args.doctor,
                       pve_config_dir=args.pve_config_dir, bwlimit_mb_s=args.bwlimit,
                       ssh_timeout_s=args.ssh_timeout, command_timeout_s=args.command_timeout,
                       from_registry=args.from_registry, ca_cert=args.ca_cert, plan=plan)
    report = push(opts)
    if args.json:
        print(json.dumps({"steps": report.steps, "doctor": report.doctor_output}, indent=2))
    return 0


def _ctid(text: str) -> int:
    try:
        ctid = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"CTID '{text}' is not a whole number; Proxmox container IDs run from "
                                         f"{proxmox.CTID_MIN} to {proxmox.CTID_MAX}") from None
    try:
        proxmox.check_ctid(ctid)
    except HostError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return ctid


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in --help, and the module docstring's layout kept."""


def register(subparsers) -> None:
    """Add `push` to the images CLI."""
    p = subparsers.add_parser("push", help="ship an image to a Proxmox host as an LXC container with GPUs",
                              formatter_class=_HelpFormatter, description=__doc__)
    p.add_argument("--host", required=True, help="USER@HOST of the Proxmox node (root: devN and raw lines need root@pam)")
    p.add_argument("--ctid", required=True, type=_ctid, help="container ID to create")
    export.add_image_arguments(p)
    p.add_argument("--format", choices=("auto", "oci", "template"), default="auto",
                   help="auto: OCI archive on PVE >= 9.1, rootfs template otherwise")
    p.add_argument("--out-dir", default=str(export.DEFAULT_OUT), help="where exports are written and reused")
    conn = p.add_argument_group("ssh")
    conn.add_argument("--port", type=int, default=22)
    conn.add_argument("--identity", help="private key file (default: agent and ~/.ssh keys)")
    conn.add_argument("--known-hosts", help="known_hosts file (default: ~/.ssh/known_hosts and the system one)")
    conn.add_argument("--accept-new-host-key", action="store_true",
                      help="trust and record an unknown host key (a changed key is still refused)")
    conn.add_argument("--compress", action="store_true", help="SSH compression (helps on slow links only)")
    conn.add_argument("--bwlimit", type=float, help="upload cap in MB/s (10**6 bytes per second)")
    ssh.add_timeout_arguments(conn)
    pull = p.add_argument_group("registry (PVE >= 9.1)")
    pull.add_argument("--from-registry", metavar="REF",
                      help="host/namespace/name:tag the host pulls itself (oci-registry-pull) instead of an upload")
    pull.add_argument("--ca-cert", help="the registry's CA, for reading the image's config from this machine")
    ct = p.add_argument_group("container")
    ct.add_argument("--hostname", default="dflash-train")
    ct.add_argument("--cores", type=int, default=8)
    ct.add_argument("--memory", type=int, default=65536, help="MiB")
    ct.add_argument("--swap", type=int, default=0, help="MiB")
    ct.add_argument("--shm-size", type=int, default=None,
                    help="MiB of the /dev/shm tmpfs (DataLoader workers, NCCL); default: half of --memory")
    ct.add_argument("--storage", default="local", help="template storage (vztmpl content)")
    ct.add_argument("--rootfs-storage", default="local-lvm")
    ct.add_argument("--rootfs-size", type=int, default=64, help="GB")
    ct.add_argument("--data-storage", help="storage for a data volume mounted at --data-path (mp0)")
    ct.add_argument("--data-size", type=int, default=0, help="GB of the data volume")
    ct.add_argument("--data-path", default="/data")
    ct.add_argument("--features", default="nesting=1")
    ct.add_argument("--privileged", action="store_true", help="create a privileged container (not recommended)")
    ct.add_argument("--net0", default="",
                    help="Proxmox netN value with a static address, e.g. name=eth0,bridge=vmbr0,ip=10.10.0.11/24,"
                         "gw=10.10.0.1 (LXC sets it before init; the image runs no DHCP client); '': loopback only")
    ct.add_argument("--gpus", default="all", help="'all', 'none' or indices like 0,1,4")
    ct.add_argument("--entrypoint", help="OCI only (PVE >= 9.1): replace the image's entrypoint, e.g. 'sleep infinity'")
    ct.add_argument("--pve-config-dir", default="/etc/pve/lxc", help="where the host keeps CTID.conf")
    act = p.add_argument_group("actions")
    act.add_argument("--replace", action="store_true", help="destroy an existing container with this CTID (and its volumes) first")
    act.add_argument("--force", action="store_true", help="overwrite a different template file of the same name")
    act.add_argument("--no-start", action="store_true", help="create but do not start (and skip the doctor)")
    act.add_argument("--doctor", default="dflash doctor", help="health check to run inside ('' to skip)")
    act.add_argument("--dry-run", action="store_true", help="read the host, print every command and file, change nothing")
    act.add_argument("--json", action="store_true", help="print the steps as JSON at the end")
    p.set_defaults(func=_cmd_push)

