"""GPU rendering against recorded listings of an 8-GPU Proxmox host (tests/data/nvidia-8gpu/)."""

from pathlib import Path

import pytest

from images import gpu
from images.errors import GpuError

DATA = Path(__file__).resolve().parents[1] / "data" / "nvidia-8gpu"


@pytest.fixture(scope="module")
def devices():
    return gpu.parse_device_listing((DATA / "ls-l-dev-nvidia.txt").read_text())


def test_listing_parses_every_node_with_real_majors(devices):
    by_path = {d.path: d for d in devices}
    assert [d.gpu_index for d in devices[:8]] == list(range(8))
    assert all(by_path[f"/dev/nvidia{i}"].major == 195 and by_path[f"/dev/nvidia{i}"].minor == i for i in range(8))
    assert (by_path["/dev/nvidiactl"].major, by_path["/dev/nvidiactl"].minor) == (195, 255)
    assert (by_path["/dev/nvidia-uvm"].major, by_path["/dev/nvidia-uvm"].minor) == (508, 0)
    assert (by_path["/dev/nvidia-uvm-tools"].major, by_path["/dev/nvidia-uvm-tools"].minor) == (508, 1)
    assert by_path["/dev/nvidia-caps/nvidia-cap1"].major == 511
    assert by_path["/dev/nvidia-caps/nvidia-cap1"].mode == 0o400
    assert by_path["/dev/nvidia-caps/nvidia-cap2"].mode == 0o444
    assert by_path["/dev/nvidia0"].mode == 0o666
    assert len(devices) == 14  # 8 GPUs, ctl, modeset, uvm, uvm-tools, 2 caps


def test_dev_lines_follow_pve_format(devices):
    chosen = gpu.select_devices(devices, "all")
    lines = gpu.render_dev_lines(chosen)
    # pve-container Config.pm: devN is "[path=]<Path>[,deny-write=<1|0>][,gid=<int>][,mode=<Octal>][,uid=<int>]"
    assert lines[0] == "dev0: /dev/nvidia0,mode=0666"
    assert lines[7] == "dev7: /dev/nvidia7,mode=0666"
    assert "dev8: /dev/nvidia-caps/nvidia-cap1,mode=0400" in lines
    assert any(line.endswith(": /dev/nvidiactl,mode=0666") for line in lines)
    assert any(line.endswith(": /dev/nvidia-uvm,mode=0666") for line in lines)
    assert any(line.endswith(": /dev/nvidia-uvm-tools,mode=0666") for line in lines)
    assert not any("modeset" in line for line in lines)  # display-only node stays on the host
    assert [int(line.split(":")[0][3:]) for line in lines] == list(range(len(lines)))


def test_raw_lines_allow_each_real_major_and_bind_every_node(devices):
    lines = gpu.render_raw_lines(gpu.select_devices(devices, "all"))
    allows = [line for line in lines if line.startswith("lxc.cgroup2.devices.allow")]
    assert allows == [
        "lxc.cgroup2.devices.allow: c 195:* rwm",
        "lxc.cgroup2.devices.allow: c 508:* rwm",
        "lxc.cgroup2.devices.allow: c 511:* rwm",
    ]
    assert "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file" in lines
    assert "lxc.mount.entry: /dev/nvidia-uvm-tools dev/nvidia-uvm-tools none bind,optional,create=file" in lines
    assert "lxc.mount.entry: /dev/nvidia-caps dev/nvidia-caps none bind,optional,create=dir" in lines
    assert not any("nvidia-cap1" in line for line in lines)  # the directory bind carries the caps


def test_select_subset_and_errors(devices):
    chosen = gpu.select_devices(devices, "1,3")
    assert [d.gpu_index for d in chosen if d.gpu_index is not None] == [1, 3]
    assert gpu.select_devices(devices, "none") == []
    with pytest.raises(GpuError, match=r"GPU\(s\) \[9\].*nvidia\{0,1,2,3,4,5,6,7\}"):
        gpu.select_devices(devices, "1,9")
    with pytest.raises(GpuError, match="comma list"):
        gpu.select_devices(devices, "first")
    no_uvm = [d for d in devices if "uvm" not in d.path]
    with pytest.raises(GpuError, match="nvidia-modprobe -u"):
        gpu.select_devices(no_uvm, "all")


def test_driver_version_and_cuda_floor():
    info = gpu.parse_driver_version((DATA / "proc-driver-nvidia-version.txt").read_text())
    assert info.text == "580.95.05" and info.open_kernel_module
    assert gpu.parse_driver_version("570.133.20\n").text == "570.133.20"
    gpu.check_driver("13.0", info)
    gpu.check_driver("12.8", info)
    old = gpu.parse_driver_version("570.133.20")
    with pytest.raises(GpuError, match=r"570.133.20 is too old for the image's CUDA 13.0.*>= 580.65.06"):
        gpu.check_driver("13.0.88", old)
    gpu.check_driver("12.8.1", old)
    with pytest.raises(GpuError, match="pass --gpus none"):
        gpu.parse_driver_version("NVIDIA-SMI has failed")


def test_driver_libraries_bind_at_their_sonames():
    libs = gpu.parse_driver_libraries((DATA / "ldconfig-p-nvidia.txt").read_text())
    names = [lib.soname for lib in libs]
    assert "libcuda.so.1" in names and "libnvidia-ml.so.1" in names and "libnvidia-gpucomp.so.580.95.05" in names
    assert "libcuda.so" not in names and "libnvidia-egl-wayland.so.1" not in names
    mounts = gpu.render_library_mounts(libs)
    assert ("lxc.mount.entry: /lib/x86_64-linux-gnu/libcuda.so.1 usr/lib/x86_64-linux-gnu/libcuda.so.1 "
            "none bind,ro,optional,create=file") in mounts
    with pytest.raises(GpuError, match="no libcuda.so.1"):
        gpu.render_library_mounts([lib for lib in libs if not lib.soname.startswith("libcuda.")])
