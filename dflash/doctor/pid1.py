"""What the entrypoint does first when it is the container's init: the part of a distribution's init that
multi-process training needs, as the exported template's /sbin/init does it (images/scripts/init.sh).

A Proxmox VE >= 9.1 container made from the OCI archive runs the image's entrypoint (`tini -- dflash
entrypoint`) as init, not the template's /sbin/init. Then, as root:

    /dev/shm  a tmpfs of $DFLASH_SHM_SIZE (tmpfs syntax: 16g, 512m, 50%), default half of MemTotal, unless one
              is mounted already (pve-container >= 6.1.10 mounts an unsized one; `push` writes a sized one)
    lo        up (SIOCSIFFLAGS), unless it is (`push` writes an `empty` network with flags up)

As another user (the image's USER, which PVE maps to lxc.init.uid) nothing can be mounted or brought up:
what is missing is said on stderr with the container config lines that provide it. Under Docker both
exist already and nothing is said.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from dflash.doctor.ipc import SHM_DIR, lo_flags

INIT_WRAPPERS = ("tini", "tini-static", "dumb-init")  # an init that only forwards signals and reaps
SHM_ENV = "DFLASH_SHM_SIZE"
SHM_SIZE = re.compile(r"[1-9][0-9]*[kKmMgGtTpPeE%]?")
SIOCSIFFLAGS = 0x8914
CONFIG_LINES = ("lxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,mode=1777,create=dir,size=16G 0 0",
                "lxc.net.99.type: empty", "lxc.net.99.flags: up")


def is_container_init(pid: int | None = None, ppid: int | None = None, proc: str = "/proc") -> bool:
    """PID 1, or the only child of an init wrapper (tini) that is PID 1."""
    pid = os.getpid() if pid is None else pid
    ppid = os.getppid() if ppid is None else ppid
    if pid == 1:
        return True
    if ppid != 1:
        return False
    try:
        with open(f"{proc}/1/comm") as f:
            return f.read().strip() in INIT_WRAPPERS
    except OSError:
        return False


def say(msg: str) -> None:
    print(f"dflash entrypoint: {msg}", file=sys.stderr, flush=True)


def shm_mounted(mounts: str = "/proc/self/mounts") -> bool:
    with open(mounts) as f:
        return any(line.split()[1:2] == [SHM_DIR] for line in f)


def shm_size() -> str:
    """$DFLASH_SHM_SIZE when it is a tmpfs size, else half of MemTotal (as init.sh)."""
    value = os.environ.get(SHM_ENV, "")
    if value and not SHM_SIZE.fullmatch(value):
        say(f"{SHM_ENV}='{value}' is not a tmpfs size (examples: 16g, 512m, 50%); using half the memory")
        value = ""
    if value:
        return value
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) // 2}k"
    return "50%"


def lo_up() -> None:
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = lo_flags() or 0
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | 1))


def prepare() -> list[str]:
    """Set up /dev/shm and lo where missing (as root); return what is still missing, each with its fix."""
    missing = []
    if not shm_mounted():
        if os.geteuid() == 0:
            size = shm_size()
            os.makedirs(SHM_DIR, exist_ok=True)
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"rw,nosuid,nodev,mode=1777,size={size}", "shm",
                                SHM_DIR], capture_output=True, text=True)
            if r.returncode != 0:
                missing.append(f"/dev/shm: mounting a {size} tmpfs failed ({r.stderr.strip()})")
        else:
            missing.append(f"/dev/shm: no tmpfs is mounted and uid {os.geteuid()} cannot mount one")
    flags = lo_flags()
    if flags is not None and not flags & 1:
        if os.geteuid() == 0:
            try:
                lo_up()
            except OSError as e:
                missing.append(f"lo: bringing it up failed ({e.strerror})")
        else:
            missing.append(f"lo: it is down and uid {os.geteuid()} cannot bring it up")
    return missing


def prepare_as_init() -> None:
    """prepare() when this process is the container's init; say what is still missing and how to fix it."""
    if not is_container_init():
        return
    missing = prepare()
    if missing:
        say("; ".join(missing) + ". Multi-process work (DataLoader workers, torchrun, NCCL) will fail. Add to the "
            "container's config (/etc/pve/lxc/CTID.conf; `python -m images push` writes these): "
            + " | ".join(CONFIG_LINES) + ", or start it as root (`pct set CTID --entrypoint` is the image's command).")
