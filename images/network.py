"""A container's network interface, from Proxmox's `netN` value to the LXC keys that configure it.

    net0: name=eth0,bridge=vmbr0,ip=10.10.0.11/24,gw=10.10.0.1     (pct.adoc, "Network" of a container)

An image from Docker carries no network management: with `--ostype unmanaged` Proxmox writes nothing
into the container (no /etc/network/interfaces), and nothing inside runs a DHCP client, so `ip=dhcp`
leaves eth0 up without an address. A static address is what works for every init, every PVE version
and both export formats: LXC itself sets `lxc.net.N.ipv4.address` / `.gateway` (and the IPv6 pair) in
the container's network namespace before init runs. `push` therefore takes static addresses only and
writes those keys as raw lines next to PVE's own `lxc.net.N.*` (type, link, name, hwaddr, flags);
`ip6=auto` (SLAAC, done by the kernel) needs nothing and is passed as is.

    parse_net(text)        -> NetConfig, or HostError naming the fix (ip=dhcp, unknown key, bad address)
    address_lines(net, n)  -> the raw lines push appends to /etc/pve/lxc/CTID.conf
    lxc_lines(net, n)      -> the whole interface for plain LXC (what PVE writes, plus the address lines)
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from .errors import HostError

# The keys of pve-container's netN format (PVE::LXC::Config, $netconf_desc).
NET_KEYS = ("name", "bridge", "hwaddr", "ip", "gw", "ip6", "gw6", "firewall", "link_down", "mtu", "rate", "tag",
            "trunks", "type", "host-managed")
EXAMPLE = "name=eth0,bridge=vmbr0,ip=10.10.0.11/24,gw=10.10.0.1"
NO_DHCP = ("nothing in the container runs a DHCP client (the image has none, and `--ostype unmanaged` sets up "
           "nothing inside), so eth0 would come up without an address")


@dataclass(frozen=True)
class NetConfig:
    name: str
    bridge: str | None = None
    ip: ipaddress.IPv4Interface | None = None  # None: no IPv4 address (ip=manual or no ip=)
    gw: ipaddress.IPv4Address | None = None
    ip6: ipaddress.IPv6Interface | str | None = None  # an address, "auto" (SLAAC) or None
    gw6: ipaddress.IPv6Address | None = None
    hwaddr: str | None = None
    mtu: int | None = None


def _fail(text: str, why: str) -> HostError:
    return HostError(f"--net0 '{text}': {why}. Example: --net0 {EXAMPLE} (one free address per node), or "
                     "--net0 '' for the loopback only.")


def parse_net(text: str) -> NetConfig:
    """Proxmox's netN value (`key=value,...`), checked: a static address or none, a gateway in reach."""
    items: dict[str, str] = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep or key not in NET_KEYS:
            raise _fail(text, f"'{part}' is not a key=value of Proxmox's netN (keys: {', '.join(NET_KEYS)})")
        items[key] = value
    if not items.get("name"):
        raise _fail(text, "name= is missing (the interface's name inside, e.g. eth0)")
    if items.get("ip") == "dhcp" or items.get("ip6") == "dhcp":
        raise _fail(text, f"{'ip' if items.get('ip') == 'dhcp' else 'ip6'}=dhcp: {NO_DHCP}. Give a static "
                    "address instead: LXC sets it before init runs")
    try:
        ip = None if items.get("ip") in (None, "manual") else ipaddress.IPv4Interface(items["ip"])
        gw = ipaddress.IPv4Address(items["gw"]) if items.get("gw") else None
        ip6 = items.get("ip6")
        ip6 = None if ip6 in (None, "manual") else ip6 if ip6 == "auto" else ipaddress.IPv6Interface(ip6)
        gw6 = ipaddress.IPv6Address(items["gw6"]) if items.get("gw6") else None
        mtu = int(items["mtu"]) if items.get("mtu") else None
    except ValueError as e:
        raise _fail(text, f"{e}") from None
    if ip is not None and "/" not in items["ip"]:
        raise _fail(text, f"ip={items['ip']} has no prefix length (write it as {ip.ip}/24, say)")
    if ip is not None and ip.network.prefixlen < 31 and ip.ip in (ip.network.network_address,
                                                                  ip.network.broadcast_address):
        raise _fail(text, f"ip={ip} is the network's {'network' if ip.ip == ip.network.network_address else 'broadcast'}"
                    " address, not one a node can have")
    if gw is not None and ip is None:
        raise _fail(text, f"gw={gw} without an ip= address: a gateway needs an address on its network")
    if gw is not None and gw not in ip.network:
        raise _fail(text, f"gw={gw} is outside ip={ip}'s network {ip.network}: the route to it would not exist")
    if gw6 is not None and not isinstance(ip6, ipaddress.IPv6Interface):
        raise _fail(text, f"gw6={gw6} without a static ip6= address")
    hwaddr = items.get("hwaddr")
    if hwaddr and not re.fullmatch(r"[0-9A-Fa-f]{2}(:[0-9A-Fa-f]{2}){5}", hwaddr):
        raise _fail(text, f"hwaddr={hwaddr} is not a MAC address (XX:XX:XX:XX:XX:XX)")
    return NetConfig(name=items["name"], bridge=items.get("bridge") or None, ip=ip, gw=gw, ip6=ip6, gw6=gw6,
                     hwaddr=hwaddr, mtu=mtu)


def address_lines(net: NetConfig, index: int = 0) -> list[str]:
    """Raw `lxc.net.N.*` lines that give the interface its static addresses and routes (config-file
    syntax `key: value`, as in /etc/pve/lxc/CTID.conf)."""
    k = f"lxc.net.{index}"
    lines = []
    if net.ip is not None:
        lines.append(f"{k}.ipv4.address: {net.ip.with_prefixlen}")
    if net.gw is not None:
        lines.append(f"{k}.ipv4.gateway: {net.gw}")
    if isinstance(net.ip6, ipaddress.IPv6Interface):
        lines.append(f"{k}.ipv6.address: {net.ip6.with_prefixlen}")
    if net.gw6 is not None:
        lines.append(f"{k}.ipv6.gateway: {net.gw6}")
    return lines


def lxc_lines(net: NetConfig, index: int = 0) -> list[str]:
    """The whole interface for plain LXC: a veth on the bridge, named and up (what pve-container writes for
    netN), then its addresses."""
    k = f"lxc.net.{index}"
    lines = [f"{k}.type: veth", f"{k}.name: {net.name}", f"{k}.flags: up"]
    if net.bridge:
        lines.append(f"{k}.link: {net.bridge}")
    if net.hwaddr:
        lines.append(f"{k}.hwaddr: {net.hwaddr}")
    if net.mtu:
        lines.append(f"{k}.mtu: {net.mtu}")
    return lines + address_lines(net, index)
