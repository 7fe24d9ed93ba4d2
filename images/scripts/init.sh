#!/bin/sh
# Minimal init for a container made from an image without one: stay up until LXC asks to halt
# (SIGPWR, lxc.signal.halt) or stop; training runs through `pct exec`.
trap 'exit 0' PWR TERM INT
while :; do sleep 3600 & wait $!; done
