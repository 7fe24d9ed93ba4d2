"""Proxmox facts parsing, plan checks and rendering, against recorded listings of an 8-GPU PVE 9.1 host."""

import subprocess
from pathlib import Path

import pytest
from packaging.version import Version

from images import gpu, network, proxmox
from images.errors import GpuError, HostError

DATA = Path(__file__).resolve().parents[1] / "data" / "nvidia-8gpu"


class RecordedHost:
    """Answers the commands gather_facts runs from the recorded files (a host, not the code under test)."""

    user = "root"

    def __init__(self, pveversion=None, ctids=(), nvidia=True):
        self.answers = {
            "pveversion": pveversion or (DATA / "pveversion.txt").read_text(),
            "pvesm status": (DATA / "pvesm-status.txt").read_text(),
            "pct list": "VMID       Status     Lock         Name\n" + "".join(f"{c} running   ct{c}\n" for c in ctids),
            "ls -l": (DATA / "ls-l-dev-nvidia.txt").read_text() if nvidia else "",
            "cat /proc/driver": (DATA / "proc-driver-nvidia-version.txt").read_text(),
            "ldconfig": (DATA / "ldconfig-p-nvidia.txt").read_text(),
        }

    def run(self, cmd, check=True):
        out = next(v for k, v in self.answers.items() if cmd.startswith(k))
        return subprocess.CompletedProcess(cmd, 0, out, "")


def facts(**kw):
    return proxmox.gather_facts(RecordedHost(**kw), "all")


def test_facts_from_a_real_host_shape():
    f = facts(ctids=(100, 101))
    assert f.pve == Version("9.1.2") and f.ctids == {100, 101}
    assert f.storages["local-zfs"].avail_bytes == 6685505202 * 1024 and not f.storages["backup"].active
    assert len(f.devices) == 14 and f.driver.text == "580.95.05"
    assert {lib.soname for lib in f.libraries} >= {"libcuda.so.1", "libnvidia-ml.so.1"}


def test_create_command_matches_pct_options():
    plan = proxmox.ContainerPlan(ctid=200, template="dflash-train-0123456789ab.tar.zst", fmt="template",
                                 rootfs_storage="local-zfs", rootfs_gb=64, data_storage="nvme-data", data_gb=2000,
                                 net0="name=eth0,bridge=vmbr0,ip=10.10.0.11/24,gw=10.10.0.1")
    argv = proxmox.render_create(plan)
    assert proxmox.shell(argv) == (
        "pct create 200 local:vztmpl/dflash-train-0123456789ab.tar.zst --hostname dflash-train --ostype unmanaged "
        "--unprivileged 1 --cores 8 --memory 65536 --swap 0 --rootfs local-zfs:64 --features nesting=1 "
        "--mp0 nvme-data:2000,mp=/data --net0 name=eth0,bridge=vmbr0,ip=10.10.0.11/24,gw=10.10.0.1")
    # --ostype unmanaged configures nothing inside: LXC sets the address before init runs
    assert proxmox.render_net_config(plan) == ["lxc.net.0.ipv4.address: 10.10.0.11/24",
                                               "lxc.net.0.ipv4.gateway: 10.10.0.1"]
    assert proxmox.render_net_config(proxmox.ContainerPlan(ctid=200, template="x", fmt="oci")) == []


def test_gpus_on_pve_9_use_pct_set_dev_lines_and_bind_driver_libraries():
    f = facts()
    plan = proxmox.ContainerPlan(ctid=200, template="x.tar.zst", fmt="template", rootfs_storage="local-zfs")
    devices = proxmox.check_plan(plan, f, image_cuda="13.0")
    (set_cmd,) = proxmox.render_set(plan, f, devices)
    assert set_cmd[:5] == ["pct", "set", "200", "--dev0", "/dev/nvidia0,mode=0666"]
    assert "--dev7" in set_cmd and "/dev/nvidia-uvm-tools,mode=0666" in set_cmd
    raw = proxmox.render_raw_config(f, devices)
    assert raw and all(line.startswith("lxc.mount.entry: /lib/x86_64-linux-gnu/") for line in raw)


def test_gpus_on_pve_8_1_use_raw_cgroup_and_mount_lines():
    f = facts(pveversion="pve-manager/8.1.4/ec5affc9e41f1d79 (running kernel: 6.5.11-8-pve)")
    plan = proxmox.ContainerPlan(ctid=200, template="x.tar.zst", fmt="template", rootfs_storage="local-zfs")
    devices = proxmox.check_plan(plan, f, image_cuda="12.8")
    assert proxmox.render_set(plan, f, devices) == []
    raw = proxmox.render_raw_config(f, devices)
    assert "lxc.cgroup2.devices.allow: c 508:* rwm" in raw
    assert "lxc.mount.entry: /dev/nvidia7 dev/nvidia7 none bind,optional,create=file" in raw


def test_every_container_gets_a_sized_dev_shm_and_a_loopback():
    """--ostype unmanaged sets up neither (nor does pve-container < 6.1.10 for OCI containers): a tmpfs on
    /dev/shm of half the memory (or --shm-size), and an `empty` network, outside net0..net31, that LXC
    brings up with lo."""
    plan = proxmox.ContainerPlan(ctid=200, template="x.tar.zst", fmt="template", memory_mb=65536)
    assert proxmox.render_ipc_config(plan) == [
        "lxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,mode=1777,create=dir,size=32768M 0 0",
        "lxc.net.99.type: empty", "lxc.net.99.flags: up"]
    bare = proxmox.ContainerPlan(ctid=200, template="x.oci.tar", fmt="oci", net0=None, shm_mb=4096)
    assert proxmox.render_ipc_config(bare)[0].endswith(",size=4096M 0 0")


@pytest.mark.parametrize("kw, plan_kw, cuda, message", [
    ({"ctids": (200,)}, {}, None, "CTID 200 is already in use.*--replace"),
    ({"pveversion": "pve-manager/8.4.1/2a5fa54a8503f96d (running kernel: 6.8.12-9-pve)"}, {"fmt": "oci"}, None,
     "OCI archives need PVE >= 9.1.*--format template"),
    ({}, {"rootfs_storage": "local-lvm"}, None, "storage 'local-lvm' does not exist.*local-zfs"),
    ({}, {"data_storage": "backup", "data_gb": 10}, None, "'backup' is not active"),
    ({}, {"data_storage": "nvme-data", "data_gb": 10**6}, None, "has 14307 GB available but 1000000 GB"),
    ({}, {"data_storage": "local-zfs", "data_gb": 7000}, None, "'local-zfs' has 6846 GB available but 7064 GB"),
    ({"nvidia": False}, {}, None, "no /dev/nvidia\\* nodes.*--gpus none"),
    ({}, {"features": "nesting=1,docker=1"}, None, "'docker=1' is not a pct feature"),
    ({}, {"ctid": 42}, None, "out of range"),
    ({}, {"shm_mb": 0}, None, r"--shm-size 0 MiB is outside 1\.\.65536 \(--memory\)"),
    ({}, {"memory_mb": 8192, "shm_mb": 16384}, None, r"--shm-size 16384 MiB is outside 1\.\.8192.*half of --memory"),
])
def test_refusals_name_the_fix(kw, plan_kw, cuda, message):
    plan = proxmox.ContainerPlan(**{"ctid": 200, "template": "x.tar.zst", "fmt": "template",
                                    "rootfs_storage": "local-zfs", **plan_kw})
    with pytest.raises(HostError, match=message):
        proxmox.check_plan(plan, facts(**kw), cuda)


def test_replace_allows_a_used_ctid_and_old_driver_is_refused():
    plan = proxmox.ContainerPlan(ctid=200, template="x", fmt="template", rootfs_storage="local-zfs", replace=True)
    proxmox.check_plan(plan, facts(ctids=(200,)), "13.0")
    old = facts()
    old.driver = gpu.parse_driver_version("570.133.20")
    with pytest.raises(GpuError, match="too old for the image's CUDA 13.0"):
        proxmox.check_plan(plan, old, "13.0")


def test_not_a_pve_host():
    with pytest.raises(HostError, match="does not look like a Proxmox VE host"):
        proxmox.parse_pveversion("bash: pveversion: command not found")


# --- net0: static addresses only, each refusal naming the fix -----------------------------------------
def test_net0_with_ipv6_renders_both_families_and_plain_lxc_gets_the_whole_interface():
    net = network.parse_net("name=eth0,bridge=vmbr1,hwaddr=BC:24:11:00:00:01,ip=192.168.5.20/24,gw=192.168.5.1,"
                            "ip6=fd00::20/64,gw6=fd00::1,mtu=9000,firewall=1")
    assert network.address_lines(net, 0) == [
        "lxc.net.0.ipv4.address: 192.168.5.20/24", "lxc.net.0.ipv4.gateway: 192.168.5.1",
        "lxc.net.0.ipv6.address: fd00::20/64", "lxc.net.0.ipv6.gateway: fd00::1"]
    assert network.lxc_lines(net, 2)[:6] == [
        "lxc.net.2.type: veth", "lxc.net.2.name: eth0", "lxc.net.2.flags: up", "lxc.net.2.link: vmbr1",
        "lxc.net.2.hwaddr: BC:24:11:00:00:01", "lxc.net.2.mtu: 9000"]
    assert network.address_lines(network.parse_net("name=eth0,bridge=vmbr0,ip=manual,ip6=auto")) == []


@pytest.mark.parametrize("net0, message", [
    ("name=eth0,bridge=vmbr0,ip=dhcp", "ip=dhcp: nothing in the container runs a DHCP client"),
    ("name=eth0,bridge=vmbr0,ip6=dhcp", "ip6=dhcp: nothing in the container runs a DHCP client"),
    ("bridge=vmbr0,ip=10.0.0.2/24", "name= is missing"),
    ("name=eth0,bridge=vmbr0,address=10.0.0.2/24", "'address=10.0.0.2/24' is not a key=value of Proxmox's netN"),
    ("name=eth0,bridge=vmbr0,ip=10.0.0.2", "ip=10.0.0.2 has no prefix length (write it as 10.0.0.2/24"),
    ("name=eth0,bridge=vmbr0,ip=10.0.0.300/24", "10.0.0.300/24"),
    ("name=eth0,bridge=vmbr0,ip=10.0.0.0/24", "is the network's network address"),
    ("name=eth0,bridge=vmbr0,ip=10.0.0.2/24,gw=10.0.1.1", "gw=10.0.1.1 is outside ip=10.0.0.2/24's network"),
    ("name=eth0,bridge=vmbr0,gw=10.0.0.1", "gw=10.0.0.1 without an ip= address"),
    ("name=eth0,bridge=vmbr0,ip=10.0.0.2/24,hwaddr=zz", "hwaddr=zz is not a MAC address"),
])
def test_bad_net0_is_refused_before_anything_is_sent(net0, message):
    plan = proxmox.ContainerPlan(ctid=200, template="x.tar.zst", fmt="template", rootfs_storage="local-zfs",
                                 gpus="none", net0=net0)
    with pytest.raises(HostError) as e:
        proxmox.check_plan(plan, facts(), image_cuda=None)
    assert message in str(e.value) and f"Example: --net0 {network.EXAMPLE}" in str(e.value)
