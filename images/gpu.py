"""NVIDIA GPUs of a Proxmox host, read from its own listings, rendered as container config lines.

Everything here is pure text in, text out: the host's `ls -l /dev/nvidia*`, `/proc/driver/nvidia/version`
and `ldconfig -p` are gathered over SSH by `images.proxmox`, so the rendering is tested against recorded
listings of a real 8-GPU host (tests/data/nvidia-8gpu/).

Two ways to hand the GPUs to a container (pve-container `Config.pm`, pve-docs `pct.adoc`):

    PVE >= 8.2 (pve-container >= 5.0.7)        any PVE / plain LXC
    ---------------------------------          ------------------------------------------------------
    dev0: /dev/nvidia0,mode=0666               lxc.cgroup2.devices.allow: c 195:* rwm
    ...                                        lxc.cgroup2.devices.allow: c 508:* rwm   (nvidia-uvm)
    devN: /dev/nvidia-uvm-tools,mode=0666      lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file
                                               ...
    PVE stats each node at start and adds      lxc.mount.entry: /dev/nvidia-caps dev/nvidia-caps none bind,optional,create=dir
    the cgroup rule itself.                    majors are read from the host: nvidia-uvm and nvidia-caps are dynamic

The container's libcuda must be the host driver's own version ("Driver/library version mismatch"
otherwise), so the host's user-space driver libraries are bind-mounted read-only at their sonames.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from packaging.version import Version

from .errors import GpuError

# Minimum Linux driver per CUDA toolkit (NVIDIA CUDA Toolkit release notes, table "CUDA Toolkit and
# Corresponding Driver Versions"). A newer toolkit on an older driver fails at cuInit.
MIN_DRIVER_FOR_CUDA: dict[str, str] = {
    "12.1": "530.30.02",
    "12.4": "550.54.14",
    "12.6": "560.28.03",
    "12.8": "570.26",
    "12.9": "575.51.03",
    "13.0": "580.65.06",
}

# User-space driver libraries a CUDA program loads (the "compute" set nvidia-container-toolkit mounts).
DRIVER_LIBRARIES = (
    "libcuda.so",
    "libcudadebugger.so",
    "libnvidia-ml.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libnvidia-gpucomp.so",
    "libnvidia-cfg.so",
)
CONTAINER_LIB_DIR = "/usr/lib/x86_64-linux-gnu"  # Debian/Ubuntu multiarch dir, searched by ld.so


@dataclass(frozen=True)
class NvidiaDevice:
    """One character device node of the NVIDIA driver on the host."""

    path: str  # /dev/nvidia0, /dev/nvidia-caps/nvidia-cap1
    major: int
    minor: int
    mode: int  # permission bits from the listing, e.g. 0o666

    @property
    def gpu_index(self) -> int | None:
        """0..N-1 for /dev/nvidiaN (one per GPU), None for control/uvm/caps nodes."""
        m = re.fullmatch(r"/dev/nvidia(\d+)", self.path)
        return int(m.group(1)) if m else None

    @property
    def is_cap(self) -> bool:
        return self.path.startswith("/dev/nvidia-caps/")


@dataclass(frozen=True)
class DriverInfo:
    version: Version
    text: str  # as the host printed it, e.g. 580.95.05
    open_kernel_module: bool


_LS_LINE = re.compile(r"^c([rwxsStT-]{9})\S*\s+\d+\s+\S+\s+\S+\s+(\d+),\s*(\d+)\s+.*?(\S+)$")


def _mode_bits(perm: str) -> int:
    bits = 0
    for i, ch in enumerate(perm):
        if ch not in "-ST":  # S/T: setuid/sticky without x; neither grants access
            bits |= 1 << (8 - i)
    return bits


def parse_device_listing(text: str) -> list[NvidiaDevice]:
    """Parse `ls -l /dev/nvidia*` (which also lists the /dev/nvidia-caps directory) into device nodes.

    Lines that are not character devices (`total 0`, blank lines, directory entries) are skipped; names
    inside a `/dev/nvidia-caps:` section get that directory prefixed."""
    devices: list[NvidiaDevice] = []
    section = ""
    for line in text.splitlines():
        line = line.rstrip()
        if line.endswith(":") and line.startswith("/"):
            section = line[:-1]
            continue
        m = _LS_LINE.match(line)
        if not m:
            continue
        name = m.group(4)
        path = name if name.startswith("/") else f"{section}/{name}"
        devices.append(NvidiaDevice(path, int(m.group(2)), int(m.group(3)), _mode_bits(m.group(1))))
    return sorted(devices, key=_device_order)


def _device_order(d: NvidiaDevice):
    # GPUs first in index order, then the shared nodes by name: dev0..dev7 map to nvidia0..nvidia7.
    return (0, d.gpu_index, "") if d.gpu_index is not None else (1, 0, d.path)


def parse_driver_version(text: str) -> DriverInfo:
    """Read the driver version from /proc/driver/nvidia/version or `nvidia-smi
    --query-gpu=driver_version --format=csv,noheader` output."""
    m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", text) or re.match(
        r"\s*(\d+\.\d+(?:\.\d+)?)\s*$", text.splitlines()[0] if text.strip() else ""
    )
    if not m:
        raise GpuError(
            "could not read the NVIDIA driver version from the host (expected /proc/driver/nvidia/version "
            f"or nvidia-smi output, got: {text.strip()[:200]!r}). Load the driver on the host "
            "(`modprobe nvidia`, `nvidia-smi`) or pass --gpus none."
        )
    return DriverInfo(Version(m.group(1)), m.group(1), "Open Kernel Module" in text)


def check_driver(cuda: str | None, driver: DriverInfo) -> None:
    """Refuse a host driver older than the image's CUDA toolkit needs (e.g. CUDA 13.0 needs >= 580)."""
    if cuda is None:
        return
    key = ".".join(cuda.split(".")[:2])
    need = MIN_DRIVER_FOR_CUDA.get(key)
    if need is None:
        known = [k for k in MIN_DRIVER_FOR_CUDA if Version(k) <= Version(key)]
        need = MIN_DRIVER_FOR_CUDA[known[-1]] if known else None
    if need is not None and driver.version < Version(need):
        raise GpuError(
            f"the host's NVIDIA driver {driver.text} is too old for the image's CUDA {cuda}, which needs "
            f"driver >= {need}. The container must use the host's driver libraries, so they cannot be "
            f"made to match: upgrade the host driver to >= {need}, or push an image built for an older "
            "CUDA (e.g. --target cu128-sm120 needs >= 570.26)."
        )


def select_devices(devices: list[NvidiaDevice], gpus: str) -> list[NvidiaDevice]:
    """Pick the nodes to pass: `gpus` is 'all', 'none' or a comma list of indices ('0,1,4').

    The control nodes (nvidiactl, nvidia-uvm, nvidia-uvm-tools, nvidia-caps) always go with any GPU;
    nvidia-modeset is display-only and left out."""
    if gpus == "none":
        return []
    cards = [d for d in devices if d.gpu_index is not None]
    if gpus == "all":
        chosen = cards
    else:
        try:
            wanted = sorted({int(x) for x in gpus.split(",") if x.strip()})
        except ValueError:
            raise GpuError(f"--gpus '{gpus}' is not 'all', 'none' or a comma list of indices like 0,1,4.") from None
        have = {d.gpu_index: d for d in cards}
        missing = [i for i in wanted if i not in have]
        if missing:
            raise GpuError(
                f"--gpus asks for GPU(s) {missing} but the host has /dev/nvidia{{{','.join(map(str, sorted(have)))}}}."
                " Pick indices from that list, or pass --gpus all."
            )
        chosen = [have[i] for i in wanted]
    if not chosen:
        return []
    names = {d.path for d in devices}
    for needed in ("/dev/nvidiactl", "/dev/nvidia-uvm"):
        if needed not in names:
            raise GpuError(
                f"the host has GPUs but no {needed}; CUDA cannot start without it. Create it on the host "
                "(`nvidia-modprobe -u -c=0`, or run `nvidia-smi` once after boot) and retry."
            )
    shared = [d for d in devices if d.gpu_index is None and d.path != "/dev/nvidia-modeset"]
    return chosen + shared


def render_dev_lines(devices: list[NvidiaDevice], first_index: int = 0) -> list[str]:
    """`devN: /dev/nvidiaX,mode=0666` lines (PVE >= 8.2; root@pam only). Modes keep the host's bits."""
    return [f"dev{first_index + i}: {d.path},mode=0{d.mode:o}" for i, d in enumerate(devices)]


def render_raw_lines(devices: list[NvidiaDevice]) -> list[str]:
    """Raw `lxc.cgroup2.devices.allow` + `lxc.mount.entry` lines for PVE < 8.2 and plain LXC."""
    majors = sorted({d.major for d in devices})
    lines = [f"lxc.cgroup2.devices.allow: c {major}:* rwm" for major in majors]
    for d in devices:
        if not d.is_cap:
            lines.append(f"lxc.mount.entry: {d.path} {d.path.lstrip('/')} none bind,optional,create=file")
    if any(d.is_cap for d in devices):
        lines.append("lxc.mount.entry: /dev/nvidia-caps dev/nvidia-caps none bind,optional,create=dir")
    return lines


@dataclass(frozen=True)
class DriverLibrary:
    soname: str  # libcuda.so.1
    host_path: str  # /lib/x86_64-linux-gnu/libcuda.so.1


def parse_driver_libraries(ldconfig_text: str) -> list[DriverLibrary]:
    """The host's user-space driver libraries from `ldconfig -p`, one per soname (x86-64 only).

    Unversioned development links (`libcuda.so`) are skipped: the loader and Triton use the soname."""
    libs: dict[str, DriverLibrary] = {}
    for line in ldconfig_text.splitlines():
        m = re.match(r"\s*(\S+)\s+\(([^)]*)\)\s+=>\s+(\S+)", line)
        if not m or "x86-64" not in m.group(2):
            continue
        soname, path = m.group(1), m.group(3)
        base = re.sub(r"\.so\..*$", ".so", soname)
        if base in DRIVER_LIBRARIES and soname != base:
            libs.setdefault(soname, DriverLibrary(soname, path))
    return sorted(libs.values(), key=lambda lib: lib.soname)


def render_library_mounts(libs: list[DriverLibrary], lib_dir: str = CONTAINER_LIB_DIR) -> list[str]:
    """Bind the host's driver libraries read-only into the container at their sonames.

    The source may be the host's soname symlink: a bind mount follows it to the versioned file, so the
    container sees exactly the host driver's libcuda (run `ldconfig` inside once to cache them)."""
    if not any(lib.soname.startswith("libcuda.so.") for lib in libs):
        raise GpuError(
            "the host's `ldconfig -p` lists no libcuda.so.1, so the container cannot get a libcuda that "
            "matches the host driver. Install the driver's user-space libraries on the host "
            "(e.g. `apt install libcuda1` or the .run installer) or pass --gpus none."
        )
    dest = lib_dir.lstrip("/")
    return [
        f"lxc.mount.entry: {lib.host_path} {dest}/{lib.soname} none bind,ro,optional,create=file"
        for lib in libs
    ]
