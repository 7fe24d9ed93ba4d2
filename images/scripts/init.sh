#!/bin/sh
# Minimal init for a container made from an image without one (dflash-images export). It does what a
# distribution's init would and multi-process training needs, then stays up until LXC asks to halt
# (SIGPWR, lxc.signal.halt) or stop; training runs through `pct exec` / `lxc-attach`:
#   /dev/shm  a tmpfs of $DFLASH_SHM_SIZE (tmpfs syntax: 16g, 512m, 50%), default half of MemTotal (on
#             Proxmox, lxcfs makes that the container's memory limit), unless one is mounted already
#             (an lxc.mount.entry in the container's config, as `python -m images push` writes)
#   lo        up: torchrun's store, gloo/NCCL bootstrap and a server on localhost need it. With `ip`,
#             `ifconfig` or else the image's python3 (SIOCSIFFLAGS): the images carry no iproute2.
#   hostname  resolves: unless /etc/hosts names it already, a line maps it to the container's first
#             non-loopback address (LXC sets a static one before init runs: `ip=` in Proxmox's netN, as
#             `python -m images push` writes it), else to 127.0.1.1 as Debian does. torch resolves the
#             hostname (a warning otherwise), and gloo binds the address it resolves to.
# $DFLASH_SHM_SIZE comes from init's environment (lxc.environment) or else the image's ENV. A step that
# fails is reported on the console and the container still starts; `dflash doctor` names what is missing.
trap 'exit 0' PWR TERM INT  # before the setup: a halt that comes during it is not lost
say() { echo "dflash init: $*" >&2; }
shm_size=${DFLASH_SHM_SIZE:-}
# shellcheck disable=SC1091  # written by the export: the image's ENV (PATH reaches the image's python3)
[ -r /etc/profile.d/dflash.sh ] && . /etc/profile.d/dflash.sh
shm_size=${shm_size:-${DFLASH_SHM_SIZE:-}}
PATH=${PATH:+$PATH:}/usr/sbin:/usr/bin:/sbin:/bin

mounted() {
  while read -r _ mnt _; do [ "$mnt" = "$1" ] && return 0; done </proc/self/mounts
  return 1
}

half_of_memory() {
  while read -r key kib _; do
    [ "$key" = MemTotal: ] && { echo "$((kib / 2))k"; return 0; }
  done </proc/meminfo
  return 1
}

setup_shm() {
  mounted /dev/shm && return 0
  case "$shm_size" in
    "") ;;
    *[!0-9kKmMgGtTpPeE%]* | [!1-9]* | *[kKmMgGtTpPeE%]?*)  # 0 would mean no limit at all
      say "DFLASH_SHM_SIZE='$shm_size' is not a tmpfs size (examples: 16g, 512m, 50%); using half the memory"
      shm_size= ;;
  esac
  [ -n "$shm_size" ] || shm_size=$(half_of_memory) || shm_size=50%
  mkdir -p /dev/shm &&
    mount -t tmpfs -o "rw,nosuid,nodev,mode=1777,size=$shm_size" shm /dev/shm ||
    say "could not mount a $shm_size tmpfs on /dev/shm: multiprocessing, DataLoader workers and NCCL will fail"
}

LO_UP_PY='import fcntl, socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sh22x", fcntl.ioctl(s, 0x8913, struct.pack("16sh22x", b"lo", 0)))[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sh22x", b"lo", flags | 1))'

setup_lo() {
  ip link set lo up 2>/dev/null && return 0
  ifconfig lo up 2>/dev/null && return 0
  for py in python3 python; do
    command -v "$py" >/dev/null 2>&1 && "$py" -c "$LO_UP_PY" 2>/dev/null && return 0
  done
  say "could not bring the loopback up (no ip, ifconfig or python3 that could): torchrun and localhost servers will fail"
}

setup_hostname() {
  name=$(cat /proc/sys/kernel/hostname 2>/dev/null)
  [ -n "$name" ] || return 0
  while read -r addr names; do
    case "$addr" in '#'*) continue ;; esac
    for n in $names; do [ "$n" = "$name" ] && return 0; done
  done </etc/hosts
  addr=$(hostname -I 2>/dev/null)
  addr=${addr%% *}
  case "$addr" in *.*) ;; *) addr=127.0.1.1 ;; esac  # IPv4 only: gloo and torchrun's store default to it
  printf '%s\t%s\n' "$addr" "$name" >>/etc/hosts ||
    say "could not add '$name' to /etc/hosts: the hostname does not resolve (torch warns; gloo needs GLOO_SOCKET_IFNAME)"
}

setup_shm
setup_lo
setup_hostname
while :; do sleep 3600 & wait $!; done
