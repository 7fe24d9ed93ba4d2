"""The doctor's shm and loopback checks (dflash/doctor/ipc.py), without LXC: on this machine, and in the
situations of a bare LXC container recreated with `unshare` in a fresh interpreter (a network namespace
whose `lo` is down; a mount namespace whose /dev is a 492 KiB tmpfs without shm; an /etc/hosts that maps
localhost elsewhere or nowhere)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.doctor import ipc
from dflash.doctor.verdict import FAIL, PASS

REPO = Path(__file__).resolve().parents[3]


def check_in_namespace(flags: list[str], setup: str, check: str) -> dict:
    """Run `ipc.<check>` (a call) in a fresh interpreter inside `unshare FLAGS` after the shell `setup`; its
    CheckResult as a dict. Skips where this kernel or user may not create the namespaces."""
    if not shutil.which("unshare"):
        pytest.skip("unshare (util-linux) is not installed")
    probe = subprocess.run(["unshare", *flags, "true"], check=False, capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create namespaces here (unshare {' '.join(flags)}): {probe.stderr.strip()}")
    code = (f"import dataclasses, json; from dflash.doctor import ipc; "
            f"print(json.dumps(dataclasses.asdict(ipc.{check})))")
    script = f"set -e\n{setup}\nexec {sys.executable} -c '{code}'"
    proc = subprocess.run(["unshare", *flags, "sh", "-c", script], check=False, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# ----------------------------------------------------------------------------------------------------
# shm
# ----------------------------------------------------------------------------------------------------
def test_shm_passes_here_with_its_size():
    if not os.path.ismount(ipc.SHM_DIR):
        pytest.skip("this machine has no /dev/shm mount")
    r = ipc.check_shm()
    assert r.status == PASS, r.reason
    assert r.details["size_bytes"] > 0 and "multiprocessing.Lock() and a 16.0 MiB shared segment work" in r.reason
    assert not [p for p in os.listdir(ipc.SHM_DIR) if p.startswith("dflash-doctor-")]  # nothing left behind


def test_shm_missing_fails_naming_the_fixes(tmp_path):
    r = ipc.check_shm(str(tmp_path / "shm"))
    assert r.status == FAIL and f"{tmp_path / 'shm'} does not exist" in r.reason
    assert "--shm-size 16g" in r.reason and "lxc.mount.entry: tmpfs dev/shm tmpfs" in r.reason
    assert "DFLASH_SHM_SIZE" in r.reason


def test_shm_segment_that_does_not_fit_is_an_error_not_a_crash():
    """posix_fallocate reserves the pages first: a full tmpfs says ENOSPC instead of killing the doctor
    with SIGBUS on the first page it writes."""
    if not os.path.ismount(ipc.SHM_DIR):
        pytest.skip("this machine has no /dev/shm mount")
    _, free = ipc.shm_capacity(ipc.SHM_DIR)
    r = ipc.check_shm(probe_bytes=free + (1 << 30))
    assert r.status == FAIL and "segment does not fit" in r.reason and "free" in r.reason


def test_shm_in_a_bare_lxc_dev():
    """LXC's autodev /dev is a 492 KiB tmpfs with no shm in it: the issue's FileNotFoundError, then with
    /dev/shm only a directory on that /dev, a segment that does not fit."""
    setup = "mount -t tmpfs -o size=492k,mode=755 none /dev"
    r = check_in_namespace(["-r", "-m"], setup, "check_shm()")
    assert r["status"] == FAIL and "/dev/shm does not exist" in r["reason"], r
    r = check_in_namespace(["-r", "-m"], setup + "\nmkdir /dev/shm && chmod 1777 /dev/shm", "check_shm()")
    assert r["status"] == FAIL and "does not fit: /dev/shm holds 492.0 KiB" in r["reason"], r
    assert r["details"]["own_mount"] is False


def test_shm_with_a_sized_tmpfs_passes_and_warns_when_small():
    setup = "mount -t tmpfs -o size=64m,mode=1777 shm /dev/shm"
    r = check_in_namespace(["-r", "-m"], setup, "check_shm()")
    assert r["status"] == PASS and "/dev/shm holds 64.0 MiB" in r["reason"] and "small" in r["reason"], r


def test_shm_read_only_fails_naming_the_mount_options(tmp_path):
    """/dev/shm itself read-only: multiprocessing.Lock() already fails; another read-only tmpfs: the segment."""
    ro = "mount -t tmpfs -o size=64m,mode=1777 shm {0} && mount -o remount,ro {0}"
    r = check_in_namespace(["-r", "-m"], ro.format("/dev/shm"), "check_shm()")
    assert r["status"] == FAIL and "multiprocessing.Lock() fails" in r["reason"] and "Read-only" in r["reason"], r
    r = check_in_namespace(["-r", "-m"], ro.format(tmp_path), f'check_shm("{tmp_path}")')
    assert r["status"] == FAIL and f"cannot create a segment in {tmp_path} (Read-only file system" in r["reason"], r
    assert "mode=1777" in r["reason"]


# ----------------------------------------------------------------------------------------------------
# loopback
# ----------------------------------------------------------------------------------------------------
def test_loopback_passes_here():
    r = ipc.check_loopback()
    assert r.status == PASS, r.reason
    assert all(a in ("127.0.0.1", "::1") for a in r.details["localhost"])


def test_loopback_down_fails_naming_the_fix():
    """A new network namespace has only `lo`, and it is down: what a container gets whose init brings
    nothing up. connect() says 'Network is unreachable', as torchrun's store did."""
    r = check_in_namespace(["-r", "-n"], "", "check_loopback()")
    assert r["status"] == FAIL and "Network is unreachable" in r["reason"] and "lo is DOWN" in r["reason"], r
    assert "ip link set lo up" in r["reason"]


def test_loopback_up_in_a_new_namespace_passes():
    if not shutil.which("ip"):
        pytest.skip("iproute2's ip is not installed")
    r = check_in_namespace(["-r", "-n"], "ip link set lo up", "check_loopback()")
    assert r["status"] == PASS, r


def test_localhost_elsewhere_fails(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("10.1.2.3 localhost\n")
    r = check_in_namespace(["-r", "-m"], f"mount --bind {hosts} /etc/hosts", "check_loopback()")
    assert r["status"] == FAIL and "resolves to 10.1.2.3, not a loopback address" in r["reason"], r


def test_localhost_unresolvable_fails_naming_etc_hosts(tmp_path):
    """An empty /etc/hosts (what `docker export` leaves) and no DNS server: `localhost` resolves nowhere."""
    if not shutil.which("ip"):
        pytest.skip("iproute2's ip is not installed")
    empty = tmp_path / "empty"
    empty.write_text("")
    setup = (f"ip link set lo up\nmount --bind {empty} /etc/hosts\nmount --bind {empty} /etc/resolv.conf\n"
             "if getent hosts localhost >/dev/null; then echo 'nsswitch resolves localhost by itself' >&2; exit 3; fi")
    probe = subprocess.run(["unshare", "-r", "-m", "-n", "sh", "-c", setup], check=False, capture_output=True,
                           text=True)
    if probe.returncode == 3:
        pytest.skip("this machine's nsswitch resolves localhost without /etc/hosts (nss-myhostname)")
    r = check_in_namespace(["-r", "-m", "-n"], setup, "check_loopback()")
    assert r["status"] == FAIL and "`localhost` does not resolve" in r["reason"], r
    assert "127.0.0.1 localhost" in r["reason"] and "/etc/hosts" in r["reason"]
