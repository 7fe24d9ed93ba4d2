"""A Proxmox VE host as push sees it: facts read over SSH, a container plan checked against them, and
the `pct` command lines and config lines that realise it (formats of pve-container 6.x `Config.pm`).

    facts   pveversion, pvesm status, pct list, ls -l /dev/nvidia*, /proc/driver/nvidia/version, ldconfig -p
    plan    what the user asked for (CTID, template, storages, GPUs, features)
    check   every refusal happens here, before anything is exported or sent:
            CTID in use without --replace, OCI on PVE < 9.1, missing/inactive/full storage,
            GPUs asked for but none (or no driver), host driver too old for the image's CUDA
    render  pct create ... / pct set --devN ... / raw lxc.* lines appended to /etc/pve/lxc/CTID.conf
            (GPU nodes and driver libraries; a sized /dev/shm and the loopback for every container;
            net0's static addresses as LXC keys, images/network.py)
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from packaging.version import Version

from . import gpu, network
from .errors import HostError

OCI_MIN_PVE = Version("9.1")  # pve-container >= 6.0.15 restores OCI archives
# ... and pve-storage's POST /nodes/NODE/storage/STORAGE/oci-registry-pull (9.1, commit 7744cf2 "api: add
# storage/{storage}/oci-registry-pull method") pulls one from a registry: `skopeo copy docker://REF
# oci-archive:DIR/NAME.tar` as root on the node, with skopeo's own trust and credentials.
PULL_MIN_PVE = OCI_MIN_PVE
DEV_MIN_PVE = Version("8.2")  # devN passthrough (pve-container >= 5.0.7)
FEATURES = ("nesting", "keyctl", "fuse", "mknod", "mount", "force_rw_sys")
CTID_MIN, CTID_MAX = 100, 999_999_999  # pve-vmid (pve-common): VMs and containers share one ID range
LOOPBACK_NET = 99  # lxc.net.<n> of the raw `empty` network that brings lo up; PVE writes net0..net31


@dataclass(frozen=True)
class Storage:
    name: str
    type: str
    active: bool
    avail_bytes: int


@dataclass
class HostFacts:
    pve: Version
    storages: dict[str, Storage]
    ctids: set[int]
    devices: list[gpu.NvidiaDevice] = field(default_factory=list)
    driver: gpu.DriverInfo | None = None
    libraries: list[gpu.DriverLibrary] = field(default_factory=list)
    user: str = "root"


def parse_pveversion(text: str) -> Version:
    m = re.search(r"pve-manager/(\d+\.\d+(?:\.\d+)?)", text)
    if not m:
        raise HostError(f"this does not look like a Proxmox VE host: `pveversion` printed {text.strip()[:120]!r}. "
                        "Push to a PVE node (or use `export` and plain LXC).")
    return Version(m.group(1))


def parse_pvesm_status(text: str) -> dict[str, Storage]:
    """`pvesm status`: Name Type Status Total Used Available % (sizes in KiB)."""
    out = {}
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) >= 6 and f[4].isdigit() and f[5].isdigit():
            out[f[0]] = Storage(f[0], f[1], f[2] == "active", int(f[5]) * 1024)
    return out


def parse_pct_list(text: str) -> set[int]:
    return {int(line.split()[0]) for line in text.splitlines()[1:] if line.split() and line.split()[0].isdigit()}


def gather_facts(host, gpus: str) -> HostFacts:
    """Read the host: `host.run(cmd, check=False)` returns an object with rc and stdout."""
    pve = parse_pveversion(host.run("pveversion", check=False).stdout)
    storages = parse_pvesm_status(host.run("pvesm status", check=False).stdout)
    ctids = parse_pct_list(host.run("pct list", check=False).stdout)
    facts = HostFacts(pve, storages, ctids, user=getattr(host, "user", "root"))
    if gpus != "none":
        facts.devices = gpu.parse_device_listing(host.run("ls -l /dev/nvidia* 2>/dev/null", check=False).stdout)
        if facts.devices:
            ver = host.run("cat /proc/driver/nvidia/version 2>/dev/null || "
                           "nvidia-smi --query-gpu=driver_version --format=csv,noheader", check=False).stdout
            facts.driver = gpu.parse_driver_version(ver)
            facts.libraries = gpu.parse_driver_libraries(
                host.run("ldconfig -p | grep -E 'libcuda|libnvidia'", check=False).stdout)
    return facts


@dataclass(frozen=True)
class ContainerPlan:
    """What to create. Sizes in GB, memory in MiB (pct's units)."""

    ctid: int
    template: str  # file name in the template storage
    fmt: str  # "oci" or "template"
    template_storage: str = "local"
    hostname: str = "dflash-train"
    cores: int = 8
    memory_mb: int = 65536
    swap_mb: int = 0
    rootfs_storage: str = "local-lvm"
    rootfs_gb: int = 64
    data_storage: str | None = None
    data_gb: int = 0
    data_path: str = "/data"
    features: str = "nesting=1"
    unprivileged: bool = True
    net0: str | None = None  # Proxmox's netN value with a static ip= (images/network.py); None: loopback only
    gpus: str = "all"
    replace: bool = False
    entrypoint: str | None = None  # PVE >= 9.1 (OCI): overrides the image's Entrypoint/Cmd after create
    shm_mb: int | None = None  # the /dev/shm tmpfs; None: half of memory_mb

    @property
    def shm_size_mb(self) -> int:
        return self.shm_mb if self.shm_mb is not None else max(1, self.memory_mb // 2)

    @property
    def volid(self) -> str:
        return f"{self.template_storage}:vztmpl/{self.template}"


def check_ctid(ctid: int) -> None:
    """Proxmox guest IDs run from 100 to 999999999 (the `pve-vmid` format of pve-common's JSONSchema.pm;
    IDs below 100 are reserved). Checked before any connection: no host would take another."""
    if not CTID_MIN <= ctid <= CTID_MAX:
        raise HostError(f"CTID {ctid} is out of range: Proxmox container IDs run from {CTID_MIN} to {CTID_MAX} "
                        f"(below {CTID_MIN} they are reserved). Pick a free ID in that range (`pct list` or "
                        "`pvesh get /cluster/nextid` on the host).")


def check_plan(plan: ContainerPlan, facts: HostFacts, image_cuda: str | None) -> list[gpu.NvidiaDevice]:
    """Refuse what cannot work, with the fix; return the GPU device nodes to pass through."""
    check_ctid(plan.ctid)
    if plan.ctid in facts.ctids and not plan.replace:
        raise HostError(f"CTID {plan.ctid} is already in use on the host. Pick a free ID (`pct list` shows the "
                        "used ones) or pass --replace to destroy that container and its volumes first.")
    if plan.fmt == "oci" and facts.pve < OCI_MIN_PVE:
        raise HostError(f"the host runs Proxmox VE {facts.pve}; OCI archives need PVE >= {OCI_MIN_PVE}. "
                        "Use --format template (a rootfs .tar.zst that every PVE version restores).")
    if plan.entrypoint and plan.fmt != "oci":
        raise HostError("--entrypoint only applies to OCI containers (PVE >= 9.1); a template container starts "
                        "its /sbin/init. Drop --entrypoint or use --format oci.")
    _check_features(plan.features, plan.unprivileged)
    if plan.net0:
        network.parse_net(plan.net0)
    if plan.shm_mb is not None and not 1 <= plan.shm_mb <= plan.memory_mb:
        raise HostError(f"--shm-size {plan.shm_mb} MiB is outside 1..{plan.memory_mb} (--memory): /dev/shm is a tmpfs "
                        "whose pages count against the container's memory. Pass a size in MiB up to --memory, or "
                        "leave it out for half of --memory.")
    wanted: dict[str, int] = {}  # GB per storage: rootfs and data volume may share one
    for name, gb in ((plan.template_storage, 0), (plan.rootfs_storage, plan.rootfs_gb),
                     (plan.data_storage, plan.data_gb)):
        if name is not None:
            wanted[name] = wanted.get(name, 0) + gb
    for name, gb in wanted.items():
        _check_storage(facts, name, gb)
    devices = gpu.select_devices(facts.devices, plan.gpus) if plan.gpus != "none" else []
    if plan.gpus != "none" and not devices:
        raise HostError("--gpus asks for GPUs but the host has no /dev/nvidia* nodes. Load the NVIDIA driver on "
                        "the host (`nvidia-smi` should list the GPUs) or pass --gpus none.")
    if devices:
        if facts.driver is None:
            raise HostError("the host has /dev/nvidia* nodes but no readable driver version; run `nvidia-smi` "
                            "on the host to see what is wrong.")
        gpu.check_driver(image_cuda, facts.driver)
        if facts.pve >= DEV_MIN_PVE and facts.user != "root":
            raise HostError(f"devN passthrough needs root@pam, but the SSH user is '{facts.user}'. Push as root@HOST.")
    return devices


def _check_features(features: str, unprivileged: bool) -> None:
    for item in filter(None, features.split(",")):
        key = item.split("=", 1)[0]
        if key not in FEATURES:
            raise HostError(f"--features '{item}' is not a pct feature (known: {', '.join(FEATURES)}).")
        if key == "keyctl" and not unprivileged:
            raise HostError("--features keyctl=1 only applies to unprivileged containers (pct.adoc).")


def _check_storage(facts: HostFacts, name: str, gb: int) -> None:
    st = facts.storages.get(name)
    if st is None:
        raise HostError(f"storage '{name}' does not exist on the host (it has: {', '.join(sorted(facts.storages))}). "
                        "Pass an existing storage; `pvesm status` lists them.")
    if not st.active:
        raise HostError(f"storage '{name}' is not active on the host. Activate it or choose another.")
    if gb * 10**9 > st.avail_bytes:
        raise HostError(f"storage '{name}' has {st.avail_bytes / 1e9:.0f} GB available but {gb} GB were asked for. "
                        "Ask for less or choose another storage.")


def render_create(plan: ContainerPlan) -> list[str]:
    """`pct create` argv (pct.adoc: pct create <vmid> <ostemplate> [OPTIONS])."""
    argv = ["pct", "create", str(plan.ctid), plan.volid,
            "--hostname", plan.hostname,
            "--ostype", "unmanaged",  # Docker images are not a distribution pct knows how to set up
            "--unprivileged", "1" if plan.unprivileged else "0",
            "--cores", str(plan.cores), "--memory", str(plan.memory_mb), "--swap", str(plan.swap_mb),
            "--rootfs", f"{plan.rootfs_storage}:{plan.rootfs_gb}"]
    if plan.features:
        argv += ["--features", plan.features]
    if plan.data_storage and plan.data_gb:
        # A storage volume, not a bind mount: bind mounts block snapshots and need root@pam.
        argv += ["--mp0", f"{plan.data_storage}:{plan.data_gb},mp={plan.data_path}"]
    if plan.net0:
        argv += ["--net0", plan.net0]
    return argv


def render_set(plan: ContainerPlan, facts: HostFacts, devices: list[gpu.NvidiaDevice]) -> list[list[str]]:
    """`pct set` commands after create: devN passthrough (PVE >= 8.2) and the OCI entrypoint override."""
    cmds = []
    if plan.entrypoint:
        cmds.append(["pct", "set", str(plan.ctid), "--entrypoint", plan.entrypoint])
    if devices and facts.pve >= DEV_MIN_PVE:
        args = []
        for line in gpu.render_dev_lines(devices):
            key, value = line.split(": ", 1)
            args += [f"--{key}", value]
        cmds.append(["pct", "set", str(plan.ctid), *args])
    return cmds


def render_ipc_config(plan: ContainerPlan) -> list[str]:
    """Raw lxc.* lines for what multi-process training needs and `--ostype unmanaged` sets up nowhere:

    - /dev/shm: a tmpfs of plan.shm_size_mb (DataLoader workers, NCCL's shared-memory transport,
      multiprocessing locks). pve-container >= 6.1.10 mounts an unsized one for OCI application
      containers only; raw lines come after its own, so this one is on top.
    - the loopback: an `empty` network with flags up is how LXC brings `lo` up without help from the
      container's init (an OCI entrypoint runs as the image's user). Its index is above PVE's net0..net31,
      so it never takes the place of a netN, now or after a later `pct set --netN`."""
    return [f"lxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,mode=1777,create=dir,size={plan.shm_size_mb}M 0 0",
            f"lxc.net.{LOOPBACK_NET}.type: empty", f"lxc.net.{LOOPBACK_NET}.flags: up"]


def render_net_config(plan: ContainerPlan) -> list[str]:
    """Raw lxc.net.0.* lines with net0's static addresses: `--ostype unmanaged` configures nothing inside
    the container, so LXC sets them, before init runs (images/network.py says why not DHCP)."""
    return network.address_lines(network.parse_net(plan.net0), 0) if plan.net0 else []


def render_raw_config(facts: HostFacts, devices: list[gpu.NvidiaDevice]) -> list[str]:
    """Raw lxc.* lines for /etc/pve/lxc/CTID.conf (no API or pct option sets them): the GPU nodes on
    PVE < 8.2, and on every version the host driver's libraries, so libcuda matches the driver."""
    if not devices:
        return []
    lines = [] if facts.pve >= DEV_MIN_PVE else gpu.render_raw_lines(devices)
    return lines + gpu.render_library_mounts(facts.libraries)


def shell(argv: list[str]) -> str:
    return shlex.join(argv)


def pull_filename(repository: str, tag: str, config_digest: str) -> str:
    """The --filename for oci-registry-pull: PVE normalises it ([^a-zA-Z0-9_.-] -> _) and appends .tar.
    It holds the image's config digest as published (the image ID), so one name is one image: a second push of the same image finds
    the file (PVE refuses to overwrite one) and another image never takes its name."""
    name = f"{repository.rsplit('/', 1)[-1]}_{tag}_{config_digest.split(':')[-1][:12]}.oci"
    return re.sub(r"[^a-zA-Z0-9_.-]", "_", name)


def render_pull(node: str, storage: str, reference: str, filename: str) -> list[str]:
    """`pvesh create` of the storage API's oci-registry-pull (PVE >= 9.1; reference: host/name:tag)."""
    return ["pvesh", "create", f"/nodes/{node}/storage/{storage}/oci-registry-pull",
            "--reference", reference, "--filename", filename]
