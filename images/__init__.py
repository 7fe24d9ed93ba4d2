"""images: the image lifecycle — engine, offline base bootstrap, builds, export, Proxmox/LXC push."""
