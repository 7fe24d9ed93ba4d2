"""A Linux bridge for the real-LXC tests that join containers over a network: created with the host's end
of a /24, removed afterwards. Traffic stays on it (no forwarding or NAT is set up)."""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager


@contextmanager
def lxc_bridge(subnet: str, tag: str):
    """Bridge `dfl<tag><pid>` (at most 15 characters) with address SUBNET.1/24, up; yields its name."""
    name = f"dfl{tag}{os.getpid() % 100000}"[:15]
    subprocess.run(["ip", "link", "add", name, "type", "bridge"], check=True, capture_output=True)
    try:
        subprocess.run(["ip", "addr", "add", f"{subnet}.1/24", "dev", name], check=True, capture_output=True)
        subprocess.run(["ip", "link", "set", name, "up"], check=True, capture_output=True)
        yield name
    finally:
        subprocess.run(["ip", "link", "del", name], check=False, capture_output=True)
