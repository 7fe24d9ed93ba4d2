"""The doctor's check of what a run across nodes needs from the container's network (`network`).

    routable   an interface other than lo is up and has an IPv4 address: torchrun's rendezvous, gloo and
               NCCL's bootstrap reach the other nodes through it
    master     under a torchrun across nodes, MASTER_ADDR resolves here (the rank-0 agent advertises its
               hostname unless given --local-addr, and another node's hostname rarely resolves)
    hostname   resolves; and when it resolves to a loopback address only, GLOO_SOCKET_IFNAME (or
               NCCL_SOCKET_IFNAME) names the interface, because gloo binds the address the hostname
               resolves to and other nodes cannot connect to 127.0.1.1

It runs when the run spans nodes: `dflash doctor --multi-node`, or under a torchrun whose WORLD_SIZE is
larger than its LOCAL_WORLD_SIZE. A single-node run needs only the loopback (ipc.py). In an LXC or
Proxmox container from the exported template, LXC sets the static address of `net0` before init, and
init maps the hostname to it in /etc/hosts (images/scripts/init.sh).
"""

from __future__ import annotations

import ipaddress
import os
import socket

from dflash.doctor.verdict import FAIL, PASS, CheckResult

SIOCGIFFLAGS = 0x8913  # <linux/sockios.h>
SIOCGIFADDR = 0x8915
IFF_UP = 0x1
IFREQ_FLAGS = "16sh22x"  # struct ifreq: ifr_name[IFNAMSIZ], then a 24-byte union
IFREQ_ADDR = "16s16s8x"  # ifr_name, then a struct sockaddr_in (16 bytes) in the union
SOCKET_IFNAME_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
NET_FIX = ("give the container an address on a network the other nodes share: on Proxmox `python -m images push "
           "--net0 name=eth0,bridge=vmbr0,ip=10.10.0.11/24,gw=10.10.0.1` (one address per node), on plain LXC "
           "`lxc.net.0.ipv4.address = 10.10.0.11/24` beside the veth's `lxc.net.0.link`")


def spans_nodes(env: dict[str, str] | None = None) -> bool:
    """Whether torchrun started this process as part of a run over several nodes."""
    env = os.environ if env is None else env
    try:
        return int(env["WORLD_SIZE"]) > int(env["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return False


def interfaces() -> list[dict]:
    """Every interface of this network namespace: name, up, IPv4 address (None when it has none)."""
    import fcntl
    import struct

    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            raw = name.encode()[:15]
            try:
                flags = struct.unpack(IFREQ_FLAGS, fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack(IFREQ_FLAGS, raw, 0)))[1]
            except OSError:
                continue  # gone since the listing
            try:
                res = fcntl.ioctl(s, SIOCGIFADDR, struct.pack(IFREQ_ADDR, raw, b""))
                addr = socket.inet_ntoa(struct.unpack(IFREQ_ADDR, res)[1][4:8])
            except OSError:  # EADDRNOTAVAIL: no IPv4 address
                addr = None
            out.append({"name": name, "up": bool(flags & IFF_UP), "ipv4": addr})
    return out


def resolve(name: str) -> list[str]:
    """IPv4 addresses `name` resolves to (empty when it does not)."""
    try:
        return sorted({ai[4][0] for ai in socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)})
    except (socket.gaierror, UnicodeError):
        return []


def check_network() -> CheckResult:
    """A routable interface, and a hostname that resolves to an address other nodes can use."""
    ifaces = interfaces()
    routable = [i for i in ifaces if i["up"] and i["ipv4"] and not ipaddress.ip_address(i["ipv4"]).is_loopback]
    host = socket.gethostname()
    addrs = resolve(host)
    pinned = {k: os.environ[k] for k in SOCKET_IFNAME_ENV if os.environ.get(k)}
    details = {"interfaces": ifaces, "hostname": host, "hostname_ipv4": addrs, "socket_ifname": pinned}
    if not routable:
        seen = ", ".join(f"{i['name']} ({'up' if i['up'] else 'DOWN'}, {i['ipv4'] or 'no IPv4'})" for i in ifaces)
        return CheckResult("network", FAIL, f"no interface besides lo is up with an IPv4 address (seen: {seen or 'none'}): "
                           f"other nodes cannot reach this one for the rendezvous or the collectives; {NET_FIX}",
                           details=details)
    names = {i["name"] for i in routable}
    # gloo takes exact names, NCCL prefixes (`=` exact, `^` excludes: not judged here), comma-separated
    bad_pins = {k: v for k, v in pinned.items() if not v.startswith("^") and not any(
        n.startswith(p) for p in v.lstrip("=").split(",") if p for n in names)}
    if bad_pins:
        pins = ", ".join(f"{k}={v}" for k, v in bad_pins.items())
        return CheckResult("network", FAIL, f"{pins} names no routable interface (routable: {', '.join(sorted(names))}); "
                           f"set it to one of those", details=details)
    master = os.environ.get("MASTER_ADDR", "")
    if spans_nodes() and master and not resolve(master):
        return CheckResult("network", FAIL, f"MASTER_ADDR '{master}' does not resolve on this node, so this worker cannot "
                           "reach rank 0's store: torchrun's rank-0 agent advertises its hostname unless given "
                           "`--local-addr`; pass `torchrun --local-addr <that node's address>` on every node (or make "
                           "the nodes' hostnames resolve everywhere, by DNS or /etc/hosts)", details=details)
    if not addrs:
        return CheckResult("network", FAIL, f"the hostname '{host}' does not resolve: torch warns and gloo cannot pick "
                           f"an address; add `{routable[0]['ipv4']} {host}` to /etc/hosts (the exported template's "
                           "init writes it at boot)", details=details)
    loopback_only = all(ipaddress.ip_address(a).is_loopback for a in addrs)
    if loopback_only and not pinned:
        return CheckResult("network", FAIL, f"the hostname '{host}' resolves to {', '.join(addrs)} only: gloo binds that "
                           "loopback address and the other nodes cannot connect to it; map the hostname to "
                           f"{routable[0]['ipv4']} in /etc/hosts, or set GLOO_SOCKET_IFNAME={routable[0]['name']} "
                           f"(NCCL_SOCKET_IFNAME={routable[0]['name']} for NCCL)", details=details)
    shown = ", ".join(f"{i['name']} {i['ipv4']}" for i in routable)
    return CheckResult("network", PASS, f"routable: {shown}; hostname '{host}' resolves to {', '.join(addrs)}"
                       + (f"; {', '.join(f'{k}={v}' for k, v in pinned.items())}" if pinned else ""), details=details)
