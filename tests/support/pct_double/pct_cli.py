"""The `pct` double: the subset of pct that push uses, on top of images.lxc (real LXC).

State: $PCT_DOUBLE_CONF_DIR/CTID.conf holds the Proxmox-style config (`key: value`, plus any raw
`lxc.*` lines appended to it, as on /etc/pve/lxc); $PCT_DOUBLE_ROOT is the LXC path. Differences from
PVE, on purpose: containers run privileged (no subuid ranges here); `devN` and `mpN` become bind mounts
at start, and a missing device node fails the start as PVE does. `netN` becomes the veth that
pve-container writes (type, name, link to the bridge, hwaddr, mtu, up) when the bridge exists on this
machine, else the container has no network; as on PVE with `--ostype unmanaged`, no address is set from
`ip=`: only raw `lxc.net.N.ipv4.*` lines (what push appends) give one.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

from images import lxc
from images.errors import LxcError

OPTIONS = re.compile(r"^(hostname|ostype|unprivileged|cores|memory|swap|rootfs|features|arch|description|"
                     r"entrypoint|onboot|mp\d+|net\d+|dev\d+)$")
OSTYPES = ("unmanaged", "debian", "ubuntu", "centos", "fedora", "opensuse", "archlinux", "alpine", "gentoo", "nixos")
ROOT = Path(os.environ.get("PCT_DOUBLE_ROOT", "/var/lib/pct-double"))
CONF_DIR = Path(os.environ.get("PCT_DOUBLE_CONF_DIR", ROOT / "conf"))
TEMPLATE_DIR = Path(os.environ.get("PCT_DOUBLE_TEMPLATE_DIR", "/var/lib/vz/template/cache"))


def die(msg: str, code: int = 255) -> None:
    print(msg, file=sys.stderr)
    sys.exit(code)


def parse_options(args: list[str]) -> dict[str, str]:
    opts = {}
    it = iter(args)
    for flag in it:
        key = flag.removeprefix("--")
        if not flag.startswith("--") or not OPTIONS.match(key):
            die(f"Unknown option: {key}\n400 unable to parse option")
        value = next(it, None)
        if value is None:
            die(f"option '{key}' needs a value")
        opts[key] = value
    return opts


def conf_path(ctid: str) -> Path:
    return CONF_DIR / f"{ctid}.conf"


def read_conf(ctid: str) -> list[tuple[str, str]]:
    path = conf_path(ctid)
    if not path.exists():
        die(f"Configuration file 'nodes/double/lxc/{ctid}.conf' does not exist")
    return [tuple(line.split(": ", 1)) for line in path.read_text().splitlines() if ": " in line]


def write_conf(ctid: str, items: list[tuple[str, str]]) -> None:
    CONF_DIR.mkdir(parents=True, exist_ok=True)
    tmp = conf_path(ctid).with_suffix(".tmp")
    tmp.write_text("".join(f"{k}: {v}\n" for k, v in items))
    os.replace(tmp, conf_path(ctid))


def container(ctid: str) -> lxc.Container:
    return lxc.Container(ctid, ROOT)


def cmd_create(ctid: str, volid: str, *args: str) -> None:
    opts = parse_options(list(args))
    if conf_path(ctid).exists():
        die(f"unable to create CT {ctid} - CT {ctid} already exists on node 'double'")
    m = re.fullmatch(r"([\w-]+):vztmpl/(.+)", volid)
    if not m or not (TEMPLATE_DIR / m.group(2)).is_file():
        die(f"unable to create CT {ctid} - volume '{volid}' does not exist")
    if opts.get("ostype", "unmanaged") not in OSTYPES:
        die(f"400 Parameter verification failed.\nostype: value '{opts['ostype']}' does not have a value in the enumeration")
    if "rootfs" in opts and not re.fullmatch(r"[\w-]+:\d+(\.\d+)?", opts["rootfs"]):
        die(f"400 Parameter verification failed.\nrootfs: invalid format - {opts['rootfs']}")
    container(ctid).create(TEMPLATE_DIR / m.group(2))
    items = [("arch", "amd64"), *opts.items()]
    write_conf(ctid, items)


def cmd_set(ctid: str, *args: str) -> None:
    items = dict(read_conf(ctid))
    raw = [(k, v) for k, v in read_conf(ctid) if k.startswith("lxc.")]
    items.update(parse_options(list(args)))
    write_conf(ctid, [(k, v) for k, v in items.items() if not k.startswith("lxc.")] + raw)


def lxc_lines(ctid: str, items: list[tuple[str, str]]) -> tuple[list[str], str | None]:
    """Translate the Proxmox config into LXC config lines (as pve-container's prestart does)."""
    lines, entrypoint = [], None
    for key, value in items:
        if key.startswith("lxc."):
            lines.append(f"{key} = {value}")
        elif re.fullmatch(r"dev\d+", key):
            path = value.split(",")[0].removeprefix("path=")
            try:
                st = os.stat(path)
            except FileNotFoundError:
                die(f"Could not get mode or device ID of {path}: No such file or directory")
            lines += [f"lxc.cgroup2.devices.allow = c {os.major(st.st_rdev)}:{os.minor(st.st_rdev)} rwm",
                      f"lxc.mount.entry = {path} {path.lstrip('/')} none bind,create=file 0 0"]
        elif re.fullmatch(r"mp\d+", key):
            mp = dict(p.split("=", 1) for p in value.split(",")[1:] if "=" in p)["mp"]
            vol = ROOT / f"{ctid}-volumes" / key
            vol.mkdir(parents=True, exist_ok=True)
            lines.append(f"lxc.mount.entry = {vol} {mp.lstrip('/')} none bind,create=dir 0 0")
        elif key == "hostname":  # pve-container: lxc.uts.name from the hostname option
            lines.append(f"lxc.uts.name = {value}")
        elif re.fullmatch(r"net\d+", key):
            lines += veth_lines(int(key[3:]), value)
        elif key == "entrypoint":
            entrypoint = value
    return lines, entrypoint


def veth_lines(index: int, value: str) -> list[str]:
    """pve-container's lxc.net.N lines for a netN value (no addresses: ostype unmanaged sets none)."""
    net = dict(p.split("=", 1) for p in value.split(",") if "=" in p)
    bridge = net.get("bridge")
    if not bridge or not Path("/sys/class/net", bridge, "bridge").is_dir():
        return []
    k = f"lxc.net.{index}"
    lines = [f"{k}.type = veth", f"{k}.link = {bridge}", f"{k}.name = {net.get('name', 'eth0')}", f"{k}.flags = up"]
    lines += [f"{k}.{lxc_key} = {net[key]}" for key, lxc_key in (("hwaddr", "hwaddr"), ("mtu", "mtu")) if key in net]
    return lines


def cmd_start(ctid: str) -> None:
    c = container(ctid)
    extra, entrypoint = lxc_lines(ctid, read_conf(ctid))
    config = (c.dir / "config").read_text().split("\n# pct double\n")[0]
    if any(line.startswith("lxc.net.0.type = veth") for line in extra):  # net0 takes the place of `empty`
        config = config.replace("lxc.net.0.type = empty\n", "")
    init = [f"lxc.init.cmd = {entrypoint}"] if entrypoint else []
    c.write_config(config + "\n# pct double\n" + "\n".join(init + extra) + "\n")
    c.start()


def cmd_exec(ctid: str, *args: str) -> None:
    read_conf(ctid)
    argv = list(args[1:] if args and args[0] == "--" else args)
    # pct exec is `lxc-attach --keep-env`: the SSH session's environment leaks in, the image's does not.
    os.execvp("lxc-attach", ["lxc-attach", "-P", str(ROOT), "-n", ctid, "--keep-env", "--", *argv])


def cmd_destroy(ctid: str, *args: str) -> None:
    read_conf(ctid)
    c = container(ctid)
    if c.state() == "RUNNING" and "--force" not in args:
        die(f"CT {ctid} is running - destroy failed")
    c.destroy()
    vols = ROOT / f"{ctid}-volumes"  # volumes owned by the container go with it, as with pct destroy
    if vols.exists():
        shutil.rmtree(vols)
    conf_path(ctid).unlink()


def cmd_list() -> None:
    print(f"{'VMID':<10} {'Status':<10} {'Lock':<12} Name")
    for conf in sorted(CONF_DIR.glob("*.conf")) if CONF_DIR.exists() else []:
        items = dict(read_conf(conf.stem))
        state = "running" if container(conf.stem).state() == "RUNNING" else "stopped"
        print(f"{conf.stem:<10} {state:<10} {'':<12} {items.get('hostname', '')}")


def main(argv: list[str]) -> None:
    if not argv:
        die("USAGE: pct <COMMAND> [ARGS] [OPTIONS]")
    cmd, args = argv[0], argv[1:]
    try:
        if cmd == "create":
            cmd_create(*args)
        elif cmd == "set":
            cmd_set(*args)
        elif cmd == "start":
            cmd_start(*args)
        elif cmd in ("stop", "shutdown"):
            read_conf(args[0])
            container(args[0]).stop()
        elif cmd == "exec":
            cmd_exec(*args)
        elif cmd == "destroy":
            cmd_destroy(*args)
        elif cmd == "status":
            read_conf(args[0])
            print("status:", "running" if container(args[0]).state() == "RUNNING" else "stopped")
        elif cmd == "list":
            cmd_list()
        elif cmd == "config":
            print("".join(f"{k}: {v}\n" for k, v in read_conf(args[0])), end="")
        else:
            die(f"pct double: unsupported command '{cmd}'")
    except LxcError as e:
        die(str(e))
    except TypeError:
        die(f"pct double: wrong arguments for '{cmd}': {' '.join(args)}")


if __name__ == "__main__":
    main(sys.argv[1:])
