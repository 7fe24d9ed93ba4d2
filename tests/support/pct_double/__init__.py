"""Test doubles for a Proxmox host: a loopback OpenSSH server and a `pct` that drives real LXC."""
