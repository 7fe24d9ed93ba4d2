"""The doctor's checks of what multi-process work needs from the container: shared memory and loopback.

    shm        multiprocessing.Lock() (a POSIX semaphore, created by sem_open in /dev/shm), then a probe
               segment allocated for real (posix_fallocate: a full tmpfs is an error here, not a SIGBUS
               later), written through one shared mapping and read back through another; size reported
    loopback   a TCP listener on 127.0.0.1 accepts a connection and echoes bytes, and `localhost`
               resolves to loopback addresses only

What fails without them: datasets' `--num-proc` workers and `multiprocessing.Lock()` (FileNotFoundError
when /dev/shm is missing), torch's DataLoader workers and NCCL's shared-memory transport (no /dev/shm, or
one too small); torchrun's rendezvous store on 127.0.0.1 and a regeneration server on localhost
("Network is unreachable" while `lo` is down). A plain LXC or Proxmox container whose init is not a
distribution's sets up neither: the exported template's /sbin/init does (images/scripts/init.sh), and
`python -m images push` also writes both into the container's config.
"""

from __future__ import annotations

import errno
import ipaddress
import mmap
import os
import secrets
import socket

from dflash.doctor.verdict import FAIL, PASS, CheckResult

SHM_DIR = "/dev/shm"
PROBE_BYTES = 16 << 20  # more than a /dev/shm that is only a directory on LXC's 492 KiB /dev can hold
SMALL_SHM = 1 << 30  # below this, pass with a warning: Docker's default 64 MiB runs out with a few workers
LOOPBACK = "127.0.0.1"
TIMEOUT_S = 5.0
SIOCGIFFLAGS = 0x8913  # <linux/sockios.h>
IFREQ = "16sh22x"  # struct ifreq: ifr_name[IFNAMSIZ], then ifr_flags in a 24-byte union

SHM_FIX = ("mount a tmpfs there: Docker `docker run --shm-size 16g`; LXC/Proxmox: boot the exported template's "
           "/sbin/init (it mounts one of $DFLASH_SHM_SIZE, default half the memory) or add `lxc.mount.entry: "
           "tmpfs dev/shm tmpfs rw,nosuid,nodev,mode=1777,create=dir,size=16G 0 0` to the container's config "
           "(`python -m images push` writes it, sized by --shm-size)")
LO_FIX = ("bring the loopback up: `ip link set lo up` as root inside the container (the exported template's "
          "/sbin/init does it at boot), or let LXC do it: `lxc.net.99.type: empty` and `lxc.net.99.flags: up` "
          "in the container's config (`python -m images push` writes them)")


def size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


# ----------------------------------------------------------------------------------------------------
# shared memory
# ----------------------------------------------------------------------------------------------------
def shm_capacity(shm_dir: str) -> tuple[int, int]:
    """(size, free) of the filesystem holding `shm_dir`, in bytes."""
    st = os.statvfs(shm_dir)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def probe_segment(shm_dir: str, nbytes: int) -> None:
    """Create a segment of `nbytes` in `shm_dir` the way shm_open does, reserve its pages, write a pattern
    through one shared mapping and read it back through a second one (what another process would map).
    Raises OSError (ENOSPC when it does not fit) or RuntimeError (the bytes did not come back)."""
    path = os.path.join(shm_dir, f"dflash-doctor-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.unlink(path)  # the open descriptor keeps it alive; nothing is left behind even on a crash
        os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now instead of SIGBUS on the first touch of a page
        stride = mmap.PAGESIZE
        with mmap.mmap(fd, nbytes) as writer, mmap.mmap(fd, nbytes) as reader:
            for off in range(0, nbytes, stride):
                writer[off] = (off // stride) % 251
            bad = [off for off in range(0, nbytes, stride) if reader[off] != (off // stride) % 251]
        if bad:
            raise RuntimeError(f"{len(bad)} of {nbytes // stride} pages read back wrong through a second mapping")
    finally:
        os.close(fd)


def check_shm(shm_dir: str = SHM_DIR, probe_bytes: int = PROBE_BYTES) -> CheckResult:
    """Shared memory works: `multiprocessing.Lock()` (only for /dev/shm, where sem_open puts it) and a
    `probe_bytes` segment in `shm_dir`."""
    if not os.path.isdir(shm_dir):
        return CheckResult("shm", FAIL, f"{shm_dir} does not exist, so multiprocessing.Lock(), datasets' --num-proc, "
                           f"DataLoader workers and NCCL's shared-memory transport all fail; {SHM_FIX}",
                           details={"dir": shm_dir})
    size, free = shm_capacity(shm_dir)
    details = {"dir": shm_dir, "size_bytes": size, "free_bytes": free, "own_mount": os.path.ismount(shm_dir),
               "probe_bytes": probe_bytes}
    seen = f"{shm_dir} holds {size_text(size)} ({size_text(free)} free)"
    if shm_dir == SHM_DIR:
        import multiprocessing

        try:
            lock = multiprocessing.Lock()
            with lock:
                pass
        except OSError as e:
            return CheckResult("shm", FAIL, f"multiprocessing.Lock() fails ({type(e).__name__}: {e}); {seen}; "
                               f"{SHM_FIX}", details=details)
    try:
        probe_segment(shm_dir, probe_bytes)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EFBIG):
            why = f"a {size_text(probe_bytes)} segment does not fit: {seen}"
        elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            mode = oct(os.stat(shm_dir).st_mode & 0o7777)
            why = (f"uid {os.getuid()} cannot create a segment in {shm_dir} ({e.strerror}; mode {mode}): mount it "
                   "read-write with mode=1777")
        else:
            why = f"a {size_text(probe_bytes)} segment fails ({type(e).__name__}: {e}); {seen}"
        return CheckResult("shm", FAIL, f"{why}; {SHM_FIX}", details=details)
    except RuntimeError as e:
        return CheckResult("shm", FAIL, f"shared mappings in {shm_dir} do not share: {e}", details=details)
    reason = f"{seen}; multiprocessing.Lock() and a {size_text(probe_bytes)} shared segment work"
    if size < SMALL_SHM:
        reason += ("; small: DataLoader workers and NCCL may run out (Docker's default is 64 MiB: "
                   "`docker run --shm-size 16g`; LXC: $DFLASH_SHM_SIZE or `push --shm-size`)")
    return CheckResult("shm", PASS, reason, details=details)


# ----------------------------------------------------------------------------------------------------
# loopback
# ----------------------------------------------------------------------------------------------------
def lo_flags() -> int | None:
    """The loopback interface's flags in this network namespace (SIOCGIFFLAGS; IFF_UP = 0x1), or None
    where it cannot be read. Not /sys/class/net: sysfs shows the namespace of whoever mounted it."""
    import fcntl
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            res = fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack(IFREQ, b"lo", 0))
        return struct.unpack(IFREQ, res)[1] & 0xFFFF
    except OSError:
        return None


def echo_over(host: str, timeout: float = TIMEOUT_S) -> None:
    """Listen on `host` (an ephemeral port), connect to it, send bytes and read them back: what torchrun's
    TCPStore and a local HTTP server need. Raises OSError with the socket's error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    payload = secrets.token_bytes(16)
    with socket.socket(family, socket.SOCK_STREAM) as server:
        server.settimeout(timeout)
        server.bind((host, 0))
        server.listen(1)
        with socket.create_connection(server.getsockname()[:2], timeout=timeout) as client:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(timeout)
                client.sendall(payload)
                got = b""
                while len(got) < len(payload):
                    chunk = conn.recv(len(payload) - len(got))
                    if not chunk:
                        break
                    got += chunk
    if got != payload:
        raise OSError(errno.EIO, f"sent {len(payload)} bytes over {host}, got {len(got)} back")


def check_loopback(host: str = LOOPBACK) -> CheckResult:
    """TCP works over the loopback interface, and `localhost` names it."""
    flags = lo_flags()
    details = {"host": host, "lo_flags": None if flags is None else hex(flags)}
    try:
        echo_over(host)
    except OSError as e:
        state = "" if flags is None else f"; lo is {'up' if flags & 1 else 'DOWN'} (flags {flags:#x})"
        return CheckResult("loopback", FAIL, f"TCP over {host} fails ({e.strerror or e}){state}: torchrun's store, "
                           f"gloo/NCCL bootstrap and a server on localhost are unreachable; {LO_FIX}", details=details)
    try:
        addrs = sorted({ai[4][0] for ai in socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)})
    except socket.gaierror as e:
        return CheckResult("loopback", FAIL, f"`localhost` does not resolve ({e.strerror}): add `127.0.0.1 localhost` "
                           "(and `::1 localhost`) to /etc/hosts", details=details)
    details["localhost"] = addrs
    elsewhere = [a for a in addrs if not ipaddress.ip_address(a.split("%")[0]).is_loopback]
    if elsewhere:
        return CheckResult("loopback", FAIL, f"`localhost` resolves to {', '.join(elsewhere)}, not a loopback address: "
                           "a server bound there is reachable from outside and torchrun's store may not answer; "
                           "make /etc/hosts map localhost to 127.0.0.1 and ::1 only", details=details)
    return CheckResult("loopback", PASS, f"TCP over {host} echoes; localhost is {', '.join(addrs)}", details=details)
