#!/bin/sh
# Run a command with the image's environment, working directory and user (dflash-images export).
set -e
. /etc/profile.d/dflash.sh
cd "${DFLASH_IMAGE_WORKDIR:-/}"
u="${DFLASH_IMAGE_USER%%:*}"
if [ "$(id -u)" = 0 ] && [ -n "$u" ] && [ "$u" != root ] && [ "$u" != 0 ]; then
  case "$u" in
    *[!0-9]*) exec runuser -u "$u" -- "$@" ;;
    *) g="${DFLASH_IMAGE_USER#*:}"; exec setpriv --reuid="$u" --regid="${g:-$u}" --clear-groups -- "$@" ;;
  esac
fi
exec "$@"
